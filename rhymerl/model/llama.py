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
    _flat_index: torch.Tensor | None = None

    @property
    def kv_len(self) -> int:
        return self.attn_mask.shape[-1]

    def flat_index(self) -> torch.Tensor:
        """Row indices into one layer's cache viewed as ``[B * kv_heads * capacity, head_dim]``,
        ordered ``[B, kv_heads, T]``; computed once per forward and shared by all layers."""
        if self._flat_index is None:
            _, B, H, cap, _ = self.k.shape
            base = (torch.arange(B, device=self.k.device) * H).view(B, 1, 1) + \
                torch.arange(H, device=self.k.device).view(1, H, 1)
            self._flat_index = (base * cap + self.write_pos.unsqueeze(1)).reshape(-1)
        return self._flat_index


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in fp32 and scale after casting back, as HF does, so bf16 matches too.
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype) * self.weight


class Attention(nn.Module):
    """GQA attention with one fused q/k/v projection (HF's separate q/k/v_proj are joined
    when a checkpoint is loaded and split when it is saved: one matmul instead of three)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.n_heads + 2 * self.n_kv) * self.head_dim,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: CacheView | None) -> torch.Tensor:
        B, T, _ = x.shape
        H, KV = self.n_heads, self.n_kv
        qkv = self.qkv_proj(x).view(B, T, H + 2 * KV, self.head_dim)
        qk, v = qkv[:, :, : H + KV], qkv[:, :, H + KV:]
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])], dim=2)
        qk = apply_rope(qk.transpose(1, 2), cos, sin)  # q and k rotated together
        q, k = qk[:, :H], qk[:, H:]
        v = v.transpose(1, 2)
        gqa = KV != H
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=gqa)
        else:
            kc, vc = cache.k[self.layer_idx], cache.v[self.layer_idx]
            idx = cache.flat_index()
            kc.view(-1, self.head_dim).index_copy_(0, idx, k.reshape(-1, self.head_dim))
            vc.view(-1, self.head_dim).index_copy_(0, idx, v.reshape(-1, self.head_dim))
            n = cache.kv_len
            out = F.scaled_dot_product_attention(q, kc[:, :, :n], vc[:, :, :n], attn_mask=cache.attn_mask,
                                                 enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * self.head_dim))


class MLP(nn.Module):
    """SwiGLU with gate and up projections fused into one matmul."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


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
                cache: CacheView | None = None, logits_index: torch.Tensor | None = None,
                return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits for ``input_ids [B, T]`` (and, with ``return_hidden``, the final hidden states
        the logits were computed from, as a second result).

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
        return (self.lm_head(h), h) if return_hidden else self.lm_head(h)

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
