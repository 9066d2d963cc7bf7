"""What a run reads from outside its folder (the base model, the reward file, data files),
pinned at its start: absolute paths in its config, and a SHA-256 of each in ``inputs.json``.
A resume that finds one changed (a retrained base, an edited reward file, another working
directory) stops naming it, unless told to accept the change (logged)."""
from __future__ import annotations

import copy
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from rhymerl.atomic_io import atomic_write_text
from rhymerl.config import ConfigError, RunConfig
from rhymerl.model.gguf import NAMED_MODELS

log = logging.getLogger(__name__)
INPUTS = "inputs.json"


def with_absolute_paths(cfg: RunConfig) -> RunConfig:
    """The config with every path outside the run folder made absolute (against the working
    directory now), so the run means the same files from any directory."""
    cfg = copy.deepcopy(cfg)

    def absolute(p: str) -> str:
        return str(Path(p).expanduser().absolute())

    if cfg.model.path and cfg.model.path not in NAMED_MODELS:  # a name (smollm2) stays a name
        cfg.model.path = absolute(cfg.model.path)
    if cfg.data.reward_file:
        cfg.data.reward_file = absolute(cfg.data.reward_file)
    cfg.data.train_files = [absolute(f) for f in cfg.data.train_files]
    cfg.data.val_files = [absolute(f) for f in cfg.data.val_files]
    cfg.sft.output_dir = absolute(cfg.sft.output_dir)
    if cfg.rollout.speculative.draft_model:
        cfg.rollout.speculative.draft_model = absolute(cfg.rollout.speculative.draft_model)
    return cfg


def digest(path: Path) -> str:
    """SHA-256 of a file, or of a folder's files (names and bytes, in name order)."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        if path.is_dir():
            h.update(f.relative_to(path).as_posix().encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def run_inputs(cfg: RunConfig, base: Path) -> dict[str, str]:
    """Each outside input's absolute path -> its SHA-256."""
    paths = [Path(base)] + [Path(f) for f in cfg.data.train_files + cfg.data.val_files]
    if cfg.data.reward_file:
        paths.append(Path(cfg.data.reward_file))
    if cfg.rollout.speculative.draft_model:
        paths.append(Path(cfg.rollout.speculative.draft_model))
    return {str(p.absolute()): digest(p) for p in paths if p.exists()}


def record_inputs(run_dir: Path, cfg: RunConfig, base: Path, inputs: dict[str, str] | None = None) -> None:
    """Write ``inputs.json`` (``inputs``: digests already computed by :func:`run_inputs`)."""
    inputs = run_inputs(cfg, base) if inputs is None else inputs
    atomic_write_text(run_dir / INPUTS, json.dumps(inputs, indent=1, sort_keys=True) + "\n")


def check_inputs(run_dir: Path, cfg: RunConfig, base: Path, *, accept_changes: bool = False) -> None:
    """On resume: every input recorded at the run's start is still there, byte for byte."""
    path = run_dir / INPUTS
    if not path.exists():
        log.warning("%s: missing (a run started by an older rhymerl); recording the inputs as they are now", path)
        record_inputs(run_dir, cfg, base)
        return
    try:
        recorded: dict[str, Any] = json.loads(path.read_text())
        if not isinstance(recorded, dict):
            raise ValueError("expected an object")
    except ValueError as e:
        raise ConfigError(f"{path}: unreadable ({e})") from e
    now = run_inputs(cfg, base)
    for name, sha in sorted(recorded.items()):
        if now.get(name) == sha:
            continue
        why = "is gone" if name not in now else "changed since the run started (SHA-256 differs)"
        if accept_changes:
            log.warning("%s %s; continuing as asked (--accept-changed-inputs): the resumed run is not the one "
                        "that started", name, why)
            continue
        raise ConfigError(f"{name}: {why}; a resume would silently train another run. Restore it, or pass "
                          f"--accept-changed-inputs to continue anyway")
    if accept_changes:
        record_inputs(run_dir, cfg, base, now)
