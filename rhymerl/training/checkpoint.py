"""Run checkpoints: written to a temporary folder and renamed, so a half-written one is never used.

A checkpoint holds the policy (HF layout, safetensors), optimizer and scheduler state,
every RNG, the dataloader position, the history store and the step. Optimizer and RNG
state use ``torch.save`` and are read back with ``weights_only=True`` (no code runs).
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rhymerl.model import CausalLM, load_pretrained, save_pretrained

DONE = "COMPLETE"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def save_checkpoint(run_dir: Path, step: int, model: CausalLM, tokenizer: Any, optimizer: torch.optim.Optimizer,
                    scheduler: Any, state: dict[str, Any], history: Any | None, keep: int = 2) -> Path:
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "policy").mkdir(parents=True)
    save_pretrained(model, tmp / "policy")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp / "policy"))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optim.pt")
    _, np_keys, np_pos, np_gauss, np_cached = np.random.get_state()
    torch.save({"torch": torch.get_rng_state(), "numpy": torch.from_numpy(np_keys.astype(np.int64)),
                "numpy_rest": torch.tensor([np_pos, np_gauss, np_cached], dtype=torch.float64),
                "python": torch.tensor(list(random.getstate()[1]), dtype=torch.int64)}, tmp / "rng.pt")
    if history is not None:
        history.save(tmp / "history.json.gz")
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=2))
    (tmp / DONE).write_text("ok\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    old = sorted(p for p in final.parent.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for p in old[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (``.tmp`` folders and ones without the marker are skipped)."""
    root = run_dir / "checkpoints"
    if not root.exists():
        return None
    done = sorted(p for p in root.glob("step_*") if not p.name.endswith(".tmp") and (p / DONE).exists())
    return done[-1] if done else None


def load_checkpoint_into(ckpt: Path, model: CausalLM, optimizer: torch.optim.Optimizer, scheduler: Any,
                         *, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Restore model weights, optimizer, scheduler and RNGs; returns ``state.json``."""
    loaded = load_pretrained(ckpt / "policy", device=device, dtype=dtype)
    if loaded.config.to_hf_dict() != model.config.to_hf_dict():
        raise ValueError(f"{ckpt}: checkpoint is of another model than the config describes")
    model.load_state_dict(loaded.state_dict())
    opt = torch.load(ckpt / "optim.pt", weights_only=True)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    rng = torch.load(ckpt / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    pos, gauss, cached = rng["numpy_rest"].tolist()
    np.random.set_state(("MT19937", rng["numpy"].numpy().astype(np.uint32), int(pos), int(gauss), cached))
    random.setstate((3, tuple(int(x) for x in rng["python"].tolist()), None))
    return json.loads((ckpt / "state.json").read_text())


def export_policy(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Copy the latest checkpoint's policy to ``out`` (default ``RUN_DIR/final_policy``)."""
    run_dir = Path(run_dir)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise FileNotFoundError(f"{run_dir}: no complete checkpoint to export")
    dest = Path(out) if out else run_dir / "final_policy"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(ckpt / "policy", dest)
    return dest
