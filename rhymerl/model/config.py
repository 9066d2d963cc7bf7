"""Model configuration read from (and written to) a Hugging Face ``config.json``.

One dataclass covers the Llama family we support: Llama, Qwen2 (q/k/v bias) and
Qwen3 (per-head q/k RMSNorm). Both the transformers-4 keys (``rope_theta`` +
``rope_scaling``) and the transformers-5 key (``rope_parameters``) are read.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass
class ModelConfig:
    """Shape and numerics of one decoder; field names follow HF's config keys."""

    model_type: str = "llama"
    vocab_size: int = 32
    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # q/k/v bias (Qwen2 sets it implicitly)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys we carry but do not use

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        model_type = d.pop("model_type", None)
        if model_type is None:
            raise ValueError("config.json has no 'model_type'")
        rope_params = d.pop("rope_parameters", None)
        rope_scaling = d.pop("rope_scaling", None)
        rope_theta = d.pop("rope_theta", None)
        if rope_params:  # transformers 5 folds theta into rope_parameters
            rope_params = dict(rope_params)
            rope_theta = rope_params.pop("rope_theta", rope_theta)
            if rope_params.get("rope_type", rope_params.get("type", "default")) != "default":
                rope_scaling = rope_params
        kw: dict[str, Any] = {"model_type": model_type}
        if rope_theta is not None:
            kw["rope_theta"] = float(rope_theta)
        kw["rope_scaling"] = rope_scaling
        names = {f for f in cls.__dataclass_fields__ if f not in ("extra", "qk_norm", "model_type")}
        for k in list(d):
            if k in names:
                kw[k] = d.pop(k)
        if model_type == "qwen2":
            kw["attention_bias"] = True
        if model_type == "qwen3":
            kw["qk_norm"] = True
        kw["extra"] = {k: v for k, v in d.items() if k in ("torch_dtype", "dtype", "use_cache")}
        return cls(**kw)

    def to_hf_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        d.pop("qk_norm")
        rope_scaling = d.pop("rope_scaling")
        d["rope_theta"] = self.rope_theta
        d["rope_parameters"] = {"rope_theta": self.rope_theta, **(rope_scaling or {"rope_type": "default"})}
        if rope_scaling:
            d["rope_scaling"] = rope_scaling
        if self.model_type == "qwen2":
            d.pop("attention_bias")
            d.pop("mlp_bias")
        if self.model_type == "qwen3":
            d.pop("mlp_bias")
        d["architectures"] = [_ARCHITECTURES[self.model_type]]
        return d

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            return cls.from_hf_dict(json.loads(path.read_text()))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")
