"""A run folder's settings are its own: ``config.yaml`` is written once, at the run's start,
and every later session in the folder (an implicit continue or ``--resume``) runs on it.

What may differ in a later session:

- placement keys (:data:`PLACEMENT_KEYS`): where the run executes, not what it learns; used
  for that session only, ``config.yaml`` keeps the original;
- ``trainer.steps``, raised to extend the run, when the learning-rate schedule does not depend
  on it (``trainer.lr_schedule=constant``): the extended run equals one configured with the new
  count from the start. It is recorded in ``config.yaml``. A cosine schedule's horizon is
  ``trainer.steps``, so extending it would change every step already trained: refused.

Anything else is refused in one line naming each key (``trainer.lr: 0.0002 -> 0.5``), never
trained silently.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from rhymerl.config import ConfigError, RunConfig, flatten, load_config, save_config
from rhymerl.field_rules import marked

# Where a run executes, not what it learns (fields marked placement): these may change when a
# run continues (for example on another number of trainer ranks: the sharded checkpoint is resharded).
PLACEMENT_KEYS = tuple(marked(RunConfig, "placement"))
EXTENSIBLE = "trainer.steps"


def changed_keys(old: RunConfig, new: RunConfig) -> dict[str, tuple[object, object]]:
    """Each dotted key whose value differs: key -> (old, new)."""
    a, b = flatten(old.to_dict()), flatten(new.to_dict())
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def _describe(changes: dict[str, tuple[object, object]]) -> str:
    return ", ".join(f"{k}: {o!r} -> {n!r}" for k, (o, n) in changes.items())


def read_run_config(run_dir: Path) -> RunConfig:
    """A run folder's own config: missing or empty is an error, never the defaults."""
    path = run_dir / "config.yaml"
    if not path.exists():
        raise ConfigError(f"{path}: missing (not a run folder, or its config was deleted); cannot resume")
    if not path.read_text().strip():
        raise ConfigError(f"{path}: empty; a run's config is never empty, refusing to resume on the defaults")
    return load_config(path)


def continued_config(run_dir: Path, wanted: RunConfig, checkpoint_step: int, *, how: str) -> RunConfig:
    """The config a later session in ``run_dir`` runs on: the folder's own, with ``wanted``'s
    placement keys and (under the rule above) its ``trainer.steps``. Any other difference is a
    :class:`ConfigError` naming each key and the two ways on. ``how``: what the user ran, for
    the message."""
    own = read_run_config(run_dir)
    changes = changed_keys(own, wanted)
    learned = {k: v for k, v in changes.items() if k not in PLACEMENT_KEYS and k != EXTENSIBLE}
    if learned:
        raise ConfigError(
            f"{run_dir} holds a run with other settings ({how}): {_describe(learned)}. Start a new run with "
            f"another trainer.output_dir, or continue this one unchanged with `rhymerl train --resume {run_dir}` "
            f"(placement keys may change: {', '.join(PLACEMENT_KEYS)}; trainer.steps may change, never below the trained step)")
    cfg = own
    if EXTENSIBLE in changes:  # recorded; placement is this session's alone
        cfg = _extended(run_dir, cfg, int(changes[EXTENSIBLE][1]), checkpoint_step)
    for key in PLACEMENT_KEYS:
        if key in changes:
            cfg = _with(cfg, key, changes[key][1])
    return cfg


def _extended(run_dir: Path, cfg: RunConfig, steps: int, checkpoint_step: int) -> RunConfig:
    old = cfg.trainer.steps
    if steps < checkpoint_step:
        raise ConfigError(f"trainer.steps: {old} -> {steps} is below the step {run_dir} has already trained "
                          f"({checkpoint_step}); a run is never shortened behind its checkpoint")
    if cfg.trainer.lr_schedule != "constant":
        raise ConfigError(f"trainer.steps: {old} -> {steps} cannot extend {run_dir}: its "
                          f"trainer.lr_schedule={cfg.trainer.lr_schedule!r} spans trainer.steps, so the steps "
                          f"already trained would have had other learning rates; start a new run instead")
    cfg = _with(cfg, EXTENSIBLE, steps)
    save_config(cfg, run_dir / "config.yaml")  # the record says what the run now is
    print(f"{run_dir}: trainer.steps {old} -> {steps} (recorded in config.yaml)")
    return cfg


def _with(cfg: RunConfig, dotted: str, value: object) -> RunConfig:
    section, key = dotted.split(".", 1)
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{key: value})})
