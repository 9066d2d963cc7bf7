"""Run checkpoints: written to a temporary folder and renamed, so a half-written one is never used.

A checkpoint holds the policy (HF layout, safetensors), the trainer's optimizer and scheduler
state (``optim.pt`` from one process; ``trainer/``, sharded by ``torch.distributed.checkpoint``,
from many ranks), every RNG, the dataloader position, the history store and the step.

What a resume trusts: ``manifest.json`` lists every file with its SHA-256, written before the
``COMPLETE`` marker; it is checked before anything else is read, so a changed, missing or added
file makes the checkpoint damaged (the previous one is used). A one-process checkpoint is read
with safetensors, JSON and torch's weights-only loader alone (no code runs, whatever else sits
in the folder); the sharded reader, whose metadata is a pickle, is used only when the
checkpoint's own state says N ranks wrote it.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from rhymerl.atomic_io import fsync_dir, fsync_tree
from rhymerl.model import CausalLM, load_pretrained, save_pretrained

DONE = "COMPLETE"
MANIFEST = "manifest.json"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def save_checkpoint(run_dir: Path, step: int, model: CausalLM, tokenizer: Any, save_trainer: Callable[[Path], None],
                    state: dict[str, Any], history: Any | None, keep: int = 2) -> Path:
    """Write step ``step``'s checkpoint; ``save_trainer(folder)`` adds the trainer's state."""
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "policy").mkdir(parents=True)
    save_pretrained(model, tmp / "policy")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp / "policy"))
    save_trainer(tmp)
    _, np_keys, np_pos, np_gauss, np_cached = np.random.get_state()
    torch.save({"torch": torch.get_rng_state(), "numpy": torch.from_numpy(np_keys.astype(np.int64)),
                "numpy_rest": torch.tensor([np_pos, np_gauss, np_cached], dtype=torch.float64),
                "python": torch.tensor(list(random.getstate()[1]), dtype=torch.int64)}, tmp / "rng.pt")
    if history is not None:
        history.save(tmp / "history.json.gz")
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=2))
    (tmp / MANIFEST).write_text(json.dumps(file_digests(tmp), indent=1, sort_keys=True))
    (tmp / DONE).write_text("ok\n")
    fsync_tree(tmp)  # every byte on disk before the folder takes its final name
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    old = sorted(p for p in final.parent.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for p in old[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    return final


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be restored; the message names the folder and the file."""


def file_digests(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` (relative POSIX paths), the marker and the
    manifest itself aside."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and rel not in (DONE, MANIFEST):
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            out[rel] = h.hexdigest()
    return out


def verify_manifest(ckpt: Path) -> None:
    """The checkpoint's files are exactly those its manifest lists, byte for byte."""
    path = ckpt / MANIFEST
    try:
        listed = json.loads(path.read_text())
        if not isinstance(listed, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in listed.items()):
            raise ValueError("expected an object of file -> SHA-256")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (written by an older rhymerl, or damaged); not trusted") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from e
    found = file_digests(ckpt)
    for name in sorted(set(listed) | set(found)):
        if name not in found:
            raise CheckpointError(f"{ckpt / name}: missing (listed in {MANIFEST})")
        if name not in listed:
            raise CheckpointError(f"{ckpt / name}: not listed in {MANIFEST} (a file was added); not trusted")
        if found[name] != listed[name]:
            raise CheckpointError(f"{ckpt / name}: SHA-256 differs from {MANIFEST} (the file changed)")


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (``.tmp`` folders and ones without the marker are skipped)."""
    root = run_dir / "checkpoints"
    if not root.exists():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
                  and (p / DONE).exists())


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint."""
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def load_checkpoint_into(ckpt: Path, model: CausalLM, load_trainer: Callable[[Path, int], None],
                         *, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Restore model weights, the trainer's state (``load_trainer(ckpt, ranks)``, ``ranks`` the
    number that wrote it) and RNGs; returns ``state.json``.

    The manifest is checked first; then every file is read and checked before any state is
    applied (the trainer's state reads all of its own before applying it); a damaged checkpoint
    raises :class:`CheckpointError` naming the file (the caller then falls back to an older one).
    """
    verify_manifest(ckpt)

    def read(name: str, fn: Any) -> Any:
        try:
            return fn(ckpt / name)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - any damage becomes one clear error
            raise CheckpointError(f"{ckpt / name}: unreadable ({type(e).__name__}: {e})") from e

    def policy(path: Path) -> dict[str, torch.Tensor]:
        loaded = load_pretrained(path, device=device, dtype=dtype)
        if loaded.config.to_hf_dict() != model.config.to_hf_dict():
            raise CheckpointError(f"{path}: checkpoint is of another model than the config describes")
        return loaded.state_dict()

    def state(path: Path) -> dict[str, Any]:
        st = json.loads(path.read_text())
        if not isinstance(st, dict) or not isinstance(st.get("step"), int) or isinstance(st["step"], bool) \
                or not isinstance(st.get("loader"), dict):
            raise ValueError("expected an object with an integer 'step' and a 'loader' object")
        if ckpt.name != checkpoint_dir(ckpt.parent.parent, st["step"]).name:
            raise ValueError(f"step {st['step']} does not match the folder's name")
        ranks = st.get("world_size", 1)
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
            raise ValueError(f"world_size {ranks!r} is not a positive integer")
        return st

    weights = read("policy", policy)
    rng = read("rng.pt", lambda p: torch.load(p, weights_only=True))
    st = read("state.json", state)
    try:
        pos, gauss, cached = rng["numpy_rest"].tolist()
        np_state = ("MT19937", rng["numpy"].numpy().astype(np.uint32), int(pos), int(gauss), cached)
        py_state = (3, tuple(int(x) for x in rng["python"].tolist()), None)
        np.random.RandomState().set_state(np_state)  # validate before touching the global RNGs
        random.Random().setstate(py_state)
        torch.random.default_generator.clone_state().set_state(rng["torch"])
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{ckpt / 'rng.pt'}: RNG state does not fit this run ({type(e).__name__}: {e})") from e
    load_trainer(ckpt, st.get("world_size", 1))
    model.load_state_dict(weights)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(np_state)
    random.setstate(py_state)
    return st


def export_policy(run_dir: str | Path, out: str | Path | None = None, *, force: bool = False) -> Path:
    """Copy the latest checkpoint's policy (its manifest checked) to ``out`` (default
    ``RUN_DIR/final_policy``), written beside it and renamed into place. An existing ``out`` is
    refused unless ``force``."""
    run_dir = Path(run_dir)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise CheckpointError(f"{run_dir}: no complete checkpoint to export")
    verify_manifest(ckpt)
    dest = Path(out) if out else run_dir / "final_policy"
    if dest.exists() and not force:
        raise CheckpointError(f"{dest}: already exists; refusing to replace it (pass --force to overwrite)")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ckpt / "policy", tmp)
    fsync_tree(tmp)
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    fsync_dir(dest.parent)
    return dest
