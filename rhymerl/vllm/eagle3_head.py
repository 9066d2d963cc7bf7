"""Eagle3 heads for vLLM's ``eagle3`` method, in the Hugging Face layout vLLM loads
(``midlayer.*``, ``fc``, ``norm``, ``lm_head``; config ``LlamaForCausalLMEagle3``), and the head as
a torch module that trains on the policy's hidden states (:mod:`rhymerl.training.update.eagle3_trainer`).

At position ``t`` the head reads three of the policy's hidden states (the residual stream entering
three of its layers; ``fc`` joins them) and the embedding of token ``t+1``, runs one decoder layer
whose attention reads both (hence its ``2 * hidden`` input), and predicts token ``t+2`` with its own
``lm_head``. It has no ``embed_tokens``: vLLM shares the policy's module, so each policy sync reaches
the head's embedding too. Its own weights are pushed with
:meth:`rhymerl.vllm.engine.VllmEngine.load_draft_weights` (in a run: with every policy sync).
The module here computes what vLLM's ``Eagle3LlamaForCausalLM`` computes for each draft step
(``norm_before_residual`` off, one layer, full draft vocabulary), the later steps from the head's own
residual stream with the draft cache vLLM keeps (EAGLE-3's training-time test).
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

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries, keys, values ``[B, heads, T, head_dim]`` (keys and values repeated to the query heads)."""
        B, T, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        rep = self.n_heads // self.n_kv
        return q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)


def _shift(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``x`` moved ``n`` places later along ``dim`` (zeros in front): entry ``t`` holds ``x[t - n]``."""
    if n == 0:
        return x
    pad = torch.zeros_like(x.narrow(dim, 0, n))
    return torch.cat([pad, x.narrow(dim, 0, x.shape[dim] - n)], dim)


def _draft_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Attention of draft step ``s = len(keys)`` as vLLM's drafter runs it: the query at ``t`` reads
    step 1's keys at positions ``<= t - (s - 1)`` (the draft's cache, written from the target's states)
    and step ``j``'s key at ``t - (s - j)`` for ``j = 2..s`` (the steps drafted before it, itself last).
    One fused attention over the steps' keys side by side, a mask choosing what each row reads."""
    s, T = len(keys), q.shape[2]
    t = torch.arange(T, device=q.device)
    seen = [t[None, :] <= (t[:, None] - (s - 1)).clamp(min=0)]  # rows t < s-1 draft nothing (masked by the caller)
    seen += [t[None, :] == t[:, None]] * (s - 1)  # step j's key, shifted to row t
    k = torch.cat([keys[0]] + [_shift(k, s - j, 2) for j, k in enumerate(keys[1:], 2)], 2)
    v = torch.cat([values[0]] + [_shift(v, s - j, 2) for j, v in enumerate(values[1:], 2)], 2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.cat(seen, -1))


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

    def forward(self, aux: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                steps: int = 1) -> list[torch.Tensor]:
        """Logits of each draft step from ``aux [B, T, 3H]`` (the policy's states at ``t``), ``embeds
        [B, T, H]`` (token ``t+1``'s embedding) and ``cos``/``sin`` of positions ``t``.

        Step 1 at ``t`` predicts token ``t+2``. Step ``s > 1`` is the head drafting from its own output,
        as vLLM feeds it: at ``t`` it reads step ``s-1``'s residual stream at ``t-1`` (no ``fc``) and token
        ``t+1``, and predicts token ``t+2``; rows ``t < s-1`` have no such chain (mask them)."""
        layer, B, T = self.midlayer, aux.shape[0], aux.shape[1]
        hidden, keys, values, logits = self.fc(aux), [], [], []
        for s in range(1, steps + 1):
            if s > 1:
                hidden = _shift(hidden, 1, 1)
            x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], -1)
            q, k, v = layer.self_attn.qkv(x, cos, sin)
            keys.append(k)
            values.append(v)
            attn = _draft_attention(q, keys, values).transpose(1, 2).reshape(B, T, -1)
            hidden = hidden + layer.self_attn.o_proj(attn)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            logits.append(self.lm_head(self.norm(hidden)))
        return logits


def new_head(cfg: ModelConfig, seed: int = 0) -> Eagle3Head:
    head = Eagle3Head(cfg)
    head.load_state_dict(head_weights(cfg, seed))
    return head
