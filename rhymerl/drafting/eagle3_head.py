"""Eagle3 heads for vLLM's ``eagle3`` method, in the Hugging Face layout vLLM loads
(``midlayer.*``, ``fc``, ``norm``, ``lm_head``; config ``LlamaForCausalLMEagle3``), and the head as
a torch module that trains on the policy's hidden states (:mod:`rhymerl.training.eagle3_trainer`).

At position ``t`` the head reads three of the policy's hidden states (the residual stream entering
three of its layers; ``fc`` joins them) and the embedding of token ``t+1``, runs one decoder layer
whose attention reads both (hence its ``2 * hidden`` input), and predicts token ``t+2`` with its own
``lm_head``. It has no ``embed_tokens``: vLLM shares the policy's module, so each policy sync reaches
the head's embedding too. Its own weights are pushed with
:meth:`rhymerl.vllm.engine.VllmEngine.load_draft_weights` (in a run: with every policy sync).
The module here computes what vLLM's ``Eagle3LlamaForCausalLM`` computes for one draft step
(``norm_before_residual`` off, one layer, full draft vocabulary).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rhymerl.model.config import ModelConfig
from rhymerl.model.llama import RMSNorm
from rhymerl.model.rope import apply_rope

PREFIX = "eagle3."  # a head's weights among the policy's when a run pushes both to its engines


def aux_layers(num_layers: int) -> list[int]:
    """The target layers whose inputs the head reads: early, middle, late (distinct ids; vLLM's
    own default repeats one when the target has fewer than six layers)."""
    if num_layers < 3:
        raise ValueError(f"an Eagle3 head reads three hidden states; the target has {num_layers} layers")
    return [1, max(2, num_layers // 2), num_layers - 1] if num_layers > 3 else [0, 1, 2]


def head_weights(cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """A fresh head for a target of config ``cfg``, named as vLLM's Eagle3 loader expects."""
    g = torch.Generator().manual_seed(seed)
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    w = {f"midlayer.self_attn.{n}_proj.weight": rand(rows, 2 * H) for n, rows in (("q", q), ("k", kv), ("v", kv))}
    w["midlayer.self_attn.o_proj.weight"] = rand(H, q)
    w.update({"midlayer.mlp.gate_proj.weight": rand(I, H), "midlayer.mlp.up_proj.weight": rand(I, H),
              "midlayer.mlp.down_proj.weight": rand(H, I), "fc.weight": rand(H, 3 * H), "lm_head.weight": rand(V, H)})
    for n in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        w[f"{n}.weight"] = torch.ones(H)
    return w


def write_head(target: str | Path, out: str | Path, *, seed: int = 0,
               weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write an Eagle3 head for the rhymerl/HF Llama-family policy in ``target`` to ``out``: a fresh
    one, or ``weights`` (an :class:`Eagle3Head`'s ``state_dict``)."""
    from safetensors.torch import save_file

    raw = json.loads((Path(target) / "config.json").read_text())
    cfg = ModelConfig.from_file(Path(target) / "config.json")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    named = weights if weights is not None else head_weights(cfg, seed)
    save_file({k: v.detach().contiguous().cpu() for k, v in named.items()}, str(out / "model.safetensors"))
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters", "hidden_act",
            "bos_token_id", "eos_token_id", "pad_token_id")
    config = {k: raw[k] for k in keep if k in raw}
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  draft_vocab_size=cfg.vocab_size, target_hidden_size=cfg.hidden_size, tie_word_embeddings=False,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": aux_layers(cfg.num_hidden_layers)})
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * H, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class _MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn, self.mlp = _Attention(cfg), _MLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)


class Eagle3Head(nn.Module):
    """The head; ``state_dict()`` names are the checkpoint's (what vLLM and :func:`write_head` use)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.midlayer = _Layer(cfg)
        self.fc = nn.Linear(3 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, aux: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Logits for token ``t+2`` from ``aux [B, T, 3H]`` (the policy's states at ``t``) and
        ``embeds [B, T, H]`` (token ``t+1``'s embedding); ``cos``/``sin`` of positions ``t``."""
        layer = self.midlayer
        residual = self.fc(aux)
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(residual)], -1)
        residual = residual + layer.self_attn(x, cos, sin)
        residual = residual + layer.mlp(layer.post_attention_layernorm(residual))
        return self.lm_head(self.norm(residual))


def new_head(cfg: ModelConfig, seed: int = 0) -> Eagle3Head:
    head = Eagle3Head(cfg)
    head.load_state_dict(head_weights(cfg, seed))
    return head
