"""A checkpoint made wider and deeper without changing what it computes.

Speed measurements need a policy whose forward costs what a larger model's does and whose
outputs are a trained policy's (a model trained for minutes here is not: it samples nearly at
random, and nothing rhymes). Zero padding gives both: the extra hidden dimensions, heads, MLP
units and layers are zeros, so the residual stream's extra dimensions stay zero and every extra
layer adds nothing, while every matmul runs at full size (dense kernels do not skip zeros).

The two things padding would change are compensated exactly: an RMSNorm over ``k`` times as
many dimensions sees a mean square ``k`` times smaller, so its weight is divided by ``sqrt(k)``
and its epsilon by ``k`` (``k`` a power of 4 keeps both exact in binary floats); attention keeps
the head size, so its scale and rotary embedding are unchanged.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from rhymerl.model.checkpoint import load_state_dict


@dataclass(frozen=True)
class Width:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int


WIDTHS = {"22m": Width(hidden_size=512, intermediate_size=1536, num_hidden_layers=7)}


def get_width(name: str) -> Width:
    if name not in WIDTHS:
        raise ValueError(f"model width {name!r} is not one of {sorted(WIDTHS)}")
    return WIDTHS[name]


def _pad(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.zeros(shape, dtype=t.dtype)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def widen_checkpoint(src: str | Path, dst: str | Path, width: Width) -> Path:
    """Write ``src`` widened to ``width`` into ``dst``, replacing it (config, weights, tokenizer files); returns ``dst``."""
    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    h0, i0, n0 = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads0, kv0 = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h0 // heads0
    h, inter, n = width.hidden_size, width.intermediate_size, width.num_hidden_layers
    k = h // h0
    if h % h0 or k & (k - 1) or k.bit_length() % 2 == 0 or inter < i0 or n < n0 or h % hd:
        raise ValueError(f"{src}: cannot widen hidden {h0} -> {h} (a power-of-4 multiple, a multiple of the "
                         f"head size {hd}), intermediate {i0} -> {inter}, layers {n0} -> {n}")
    heads = h // hd
    kv = heads * kv0 // heads0  # the same number of query heads per key/value head
    scale = 1.0 / (k ** 0.5)  # exact: k is a power of 4
    sd = load_state_dict(src)
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            out[name] = _pad(t * scale, (h,))
        elif name.endswith(("q_proj.weight", "o_proj.weight")):
            out[name] = _pad(t, (h, h))
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            out[name] = _pad(t, (kv * hd, h))
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            out[name] = _pad(t, (inter, h))
        elif name.endswith("down_proj.weight"):
            out[name] = _pad(t, (h, inter))
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = _pad(t, (t.shape[0], h))
        else:
            raise ValueError(f"{src}: cannot widen tensor {name} {tuple(t.shape)}")
    template = {key: v for key, v in out.items() if key.startswith("model.layers.0.")}
    for layer in range(n0, n):  # extra layers: their outputs (o_proj, down_proj) are zero
        for key, v in template.items():
            norm = key.endswith("layernorm.weight")
            out[key.replace("layers.0.", f"layers.{layer}.")] = torch.ones_like(v) * scale if norm else \
                torch.zeros_like(v)
    cfg.update(hidden_size=h, intermediate_size=inter, num_hidden_layers=n, num_attention_heads=heads,
               num_key_value_heads=kv, head_dim=hd, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6) / k)
    tmp = dst.with_name(dst.name + ".partial")  # renamed into place whole: a killed write leaves no half model
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({key: v.contiguous() for key, v in out.items()}, str(tmp / "model.safetensors"))
    for f in src.iterdir():  # the tokenizer's and generation's files
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy2(f, tmp / f.name)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst


def parameter_count(folder: str | Path) -> int:
    return sum(t.numel() for t in load_state_dict(folder).values())


__all__ = ["WIDTHS", "Width", "get_width", "parameter_count", "widen_checkpoint"]
