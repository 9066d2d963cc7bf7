"""Hugging Face folder layout: ``config.json`` plus ``model.safetensors`` (or shards and an index).

Only safetensors are read: pickled ``.bin`` weights can run code when loaded.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode

from rhymerl.atomic_io import atomic_write_text, fsync_dir, fsync_file
from rhymerl.model.config import ModelConfig
from rhymerl.model.llama import CausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def hf_to_ours(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Join HF's q/k/v_proj into qkv_proj and gate/up_proj into gate_up_proj (other keys pass)."""
    out = dict(sd)
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for kind in ("weight", "bias"):
            parts = [f"{a}{p}_proj.{kind}" for p in "qkv"]
            if all(p in out for p in parts):
                out[f"{a}qkv_proj.{kind}"] = torch.cat([out.pop(p) for p in parts], 0)
            parts = [f"{m}{p}_proj.{kind}" for p in ("gate", "up")]
            if all(p in out for p in parts):
                out[f"{m}gate_up_proj.{kind}"] = torch.cat([out.pop(p) for p in parts], 0)
    return out


def ours_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_ours`: the tensor names transformers expects."""
    assert cfg.head_dim is not None
    out = dict(sd)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for kind in ("weight", "bias"):
            if f"{a}qkv_proj.{kind}" in out:
                for name, t in zip("qkv", out.pop(f"{a}qkv_proj.{kind}").split([q, kv, kv], 0)):
                    out[f"{a}{name}_proj.{kind}"] = t
            if f"{m}gate_up_proj.{kind}" in out:
                g, u = out.pop(f"{m}gate_up_proj.{kind}").chunk(2, 0)
                out[f"{m}gate_proj.{kind}"], out[f"{m}up_proj.{kind}"] = g, u
    return out


def _weight_files(folder: Path) -> list[Path]:
    if (folder / INDEX_FILE).exists():
        index = json.loads((folder / INDEX_FILE).read_text())
        files = []
        for name in sorted(set(index["weight_map"].values())):
            f = folder / name
            # a shard is a file in this folder: an index naming any other path is refused
            if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
                raise ValueError(f"{folder / INDEX_FILE}: weight file {name!r} is not a file of this folder; refused")
            files.append(f)
        return files
    if (folder / SINGLE_FILE).exists():
        return [folder / SINGLE_FILE]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise ValueError(f"{folder}: only pickled weights (.bin/.pt) found; rhymerl loads safetensors only "
                         "(convert with transformers' save_pretrained(safe_serialization=True))")
    raise FileNotFoundError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}")


def load_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder, on CPU, in their stored dtype."""
    out: dict[str, torch.Tensor] = {}
    for f in _weight_files(Path(folder)):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


def check_state_dict(model: CausalLM, sd: dict[str, torch.Tensor], source: str) -> None:
    """Raise a message naming every missing, unexpected or wrongly shaped tensor."""
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    wrong = [f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(expected[k])}"
             for k in expected if k in sd and sd[k].shape != expected[k]]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        if wrong:
            parts.append(f"shape mismatch {wrong[:5]}")
        raise ValueError(f"{source}: weights do not fit this model config (a checkpoint of another model?): "
                         + "; ".join(parts))


class _NoRandomInit(TorchFunctionMode):
    """Skips the in-place random initialisation of parameters built on the meta device (they get
    the checkpoint's values): on meta, ``normal_`` runs through torch's reference decompositions,
    whose first use imports the compiler stack (1.4-1.8 s of every process that loads a model)."""

    SKIP = frozenset({"normal_", "uniform_", "kaiming_uniform_", "trunc_normal_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in self.SKIP:
            return args[0] if args else kwargs["tensor"]  # the tensor, unfilled
        return func(*args, **(kwargs or {}))


def load_pretrained(path: str | Path, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> CausalLM:
    """Load an HF-format Llama/Qwen2/Qwen3 folder into our :class:`CausalLM`."""
    folder = Path(path)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder}: no config.json (is this a model folder?)")
    cfg = ModelConfig.from_file(folder / "config.json")
    with torch.device("meta"), _NoRandomInit():
        model = CausalLM(cfg)
    sd = hf_to_ours(load_state_dict(folder), cfg)
    check_state_dict(model, sd, str(folder))
    sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    model.load_state_dict(sd, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device).eval()


def save_pretrained(model: CausalLM, path: str | Path, *, max_shard_bytes: int = 2 * 1024**3) -> None:
    """Write ``config.json`` and safetensors (sharded with an index above ``max_shard_bytes``).

    Files are written beside their final names and renamed into place, so a reader never
    sees a half-written weight file.
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous().cpu() for k, v in ours_to_hf(model.state_dict(), model.config).items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in sd.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        _atomic_save(shards[0], folder / SINGLE_FILE, meta)
        (folder / INDEX_FILE).unlink(missing_ok=True)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _atomic_save(shard, folder / name, meta)
            weight_map.update({k: name for k in shard})
        total = sum(v.numel() * v.element_size() for v in sd.values())
        atomic_write_text(folder / INDEX_FILE, json.dumps({"metadata": {"total_size": total},
                                                            "weight_map": weight_map}, indent=2))
        (folder / SINGLE_FILE).unlink(missing_ok=True)
    atomic_write_text(folder / "config.json", json.dumps(model.config.to_hf_dict(), indent=2) + "\n")


def _atomic_save(tensors: dict[str, torch.Tensor], dest: Path, meta: dict[str, str]) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    fsync_file(tmp)
    os.replace(tmp, dest)
    fsync_dir(dest.parent)
