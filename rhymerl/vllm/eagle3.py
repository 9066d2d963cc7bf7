"""Eagle3 heads for vLLM's ``eagle3`` method, in the Hugging Face layout vLLM loads
(``midlayer.*``, ``fc``, ``norm``, ``lm_head``; config ``LlamaForCausalLMEagle3``).

An Eagle3 head drafts from three of the target's hidden states (``fc`` joins them) plus the
embedding of the last token, through one decoder layer whose attention reads both (hence its
``2 * hidden`` input), and its own ``lm_head``. It has no ``embed_tokens`` of its own: vLLM shares
the target's, by module reference, so a weight sync of the target reaches the head's embedding
too (``tests/test_vllm.py`` checks it). A head this module writes is freshly initialised: it
makes vLLM's ``eagle3`` path runnable on any rhymerl policy (tests, wiring); a useful head is
trained on the policy's hidden states (SpecForge, or NeMo-RL's online training) and then pushed
with :meth:`rhymerl.vllm.engine.VllmEngine.load_draft_weights`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from rhymerl.model.config import ModelConfig


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


def write_head(target: str | Path, out: str | Path, *, seed: int = 0) -> Path:
    """Write a fresh Eagle3 head for the rhymerl/HF Llama-family policy in ``target`` to ``out``."""
    from safetensors.torch import save_file

    raw = json.loads((Path(target) / "config.json").read_text())
    cfg = ModelConfig.from_file(Path(target) / "config.json")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in head_weights(cfg, seed).items()}, str(out / "model.safetensors"))
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters", "hidden_act",
            "bos_token_id", "eos_token_id", "pad_token_id")
    config = {k: raw[k] for k in keep if k in raw}
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  draft_vocab_size=cfg.vocab_size, target_hidden_size=cfg.hidden_size, tie_word_embeddings=False,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": aux_layers(cfg.num_hidden_layers)})
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out
