"""A Llama-family decoder (Llama, Qwen2, Qwen3) whose parameter names match Hugging Face's.

The forward pass takes explicit position ids and, when it runs against the engine's KV
cache, an explicit attention mask over that cache: the engine scores token *trees* (many
candidate continuations per request in one pass), which needs both.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rhymerl.model.config import ModelConfig
from rhymerl.model.rope import RotaryEmbedding, apply_rope


@dataclass
class CacheView:
    """The part of a KV cache one forward pass reads and writes.

    ``k``/``v``: ``[layers, B, kv_heads, capacity, head_dim]`` views, one row per batch row.
    ``write_pos``: ``[B, T]`` cache index where each new token's K/V is stored.
    ``attn_mask``: ``[B, 1, T, kv_len]`` bool, True where a query may attend.
    """

    k: torch.Tensor
    v: torch.Tensor
    write_pos: torch.Tensor
    attn_mask: torch.Tensor

    @property
    def kv_len(self) -> int:
        return self.attn_mask.shape[-1]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and scale after casting back, as HF does, so bf16 matches too.
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: CacheView | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=self.n_kv != self.n_heads)
        else:
            kc, vc = cache.k[self.layer_idx], cache.v[self.layer_idx]
            rows = torch.arange(B, device=x.device).unsqueeze(1).expand(B, T)
            # Advanced indices on dims 0 and 2 put [B, T] first: the value is [B, T, kv, D].
            kc[rows, :, cache.write_pos] = k.transpose(1, 2)
            vc[rows, :, cache.write_pos] = v.transpose(1, 2)
            n = cache.kv_len
            out = F.scaled_dot_product_attention(q, kc[:, :, :n], vc[:, :, :n], attn_mask=cache.attn_mask,
                                                 enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: CacheView | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                          cfg.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                cache: CacheView | None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, cache)
        return self.norm(x)


class CausalLM(nn.Module):
    """Decoder plus LM head. ``model(input_ids)`` returns logits ``[B, T, vocab]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: CacheView | None = None, logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for ``input_ids [B, T]``.

        ``positions [B, T]`` default to ``0..T-1``. With ``cache`` the new K/V are written to
        the cache and attention follows ``cache.attn_mask``; without it attention is causal
        over ``input_ids`` alone. ``logits_index [B, K]`` selects which positions get logits
        (``[B, K, vocab]``), sparing the vocabulary projection of a whole prompt.
        """
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        h = self.model(input_ids, positions, cache)
        if logits_index is not None:
            h = h.gather(1, logits_index.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        return self.lm_head(h)

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Deterministic random init (normal for matrices, ones for norms, zero biases)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
