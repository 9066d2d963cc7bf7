"""What a run checkpoints beside its weights and optimizer (``state.json`` and the async
snapshots), read back whole or refused: :func:`read_run_state` checks every field before the
run takes any of it, so a malformed checkpoint is skipped, never used half-way."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rhymerl.data import PromptRow
from rhymerl.training.rollout.batch import ScoredRollout
from rhymerl.training.checkpoint import CheckpointError
from rhymerl.training.rollout.partial import CarriedGroup
from rhymerl.training.rollout.policy_versions import InFlight


@dataclass
class RunState:
    """The loop's own state at a checkpoint."""

    step: int
    loader: dict[str, Any]  # PromptLoader.state_dict()
    carried: list[CarriedGroup]  # paused groups waiting for the next step
    bad_steps: int
    inflight: InFlight | None  # async: the batch in flight, saved whole
    snapshots: dict[int, dict[str, torch.Tensor]]  # async: older policy versions later batches are drawn by
    initial_accuracy: dict[str, float] | None
    initial_heldout: dict[str, list[float]]
    gate: list  # the workers' gate states
    placement: dict[str, Any]  # HistoPipe's placement scores and length error (empty: before they were saved)


def read_run_state(ckpt: Path, state: dict[str, Any], row_of: dict[str, PromptRow]) -> RunState:
    """``state`` (the checkpoint's ``state.json``, its digests already verified) as a
    :class:`RunState`; anything malformed raises :class:`CheckpointError` naming the file."""
    try:
        inflight = state.get("inflight")
        inflight = None if inflight is None else InFlight(
            int(inflight["step"]), ScoredRollout.from_dict(inflight["rollout"], row_of))
        snapshots = {}
        if (ckpt / "snapshots.pt").exists():
            snapshots = {int(v): named for v, named in
                         torch.load(ckpt / "snapshots.pt", weights_only=True).items()}
        initial = state.get("initial_accuracy")
        if initial is not None and not (isinstance(initial, dict) and all(
                isinstance(v, (int, float)) for v in initial.values())):
            raise ValueError(f"initial_accuracy {initial!r} is not a mapping of numbers")
        heldout = state.get("initial_heldout", {})
        if not isinstance(heldout, dict) or not all(isinstance(v, list) for v in heldout.values()):
            raise ValueError(f"initial_heldout {heldout!r} is not a mapping of lists")
        gate = state.get("gate")
        placement = state.get("placement") or {}
        if placement and not (isinstance(placement, dict) and isinstance(placement.get("scores"), dict)
                              and isinstance(placement.get("steps"), int)
                              and isinstance(placement.get("length_error_sigma"), (int, float))):
            raise ValueError(f"placement {placement!r} is not HistoPipe's placement state")
        return RunState(step=state["step"], loader=state["loader"],
                        carried=[CarriedGroup.from_dict(d) for d in state.get("carried", [])],
                        bad_steps=int(state.get("bad_steps", 0)), inflight=inflight, snapshots=snapshots,
                        initial_accuracy=initial,
                        initial_heldout={str(k): [float(x) for x in v] for k, v in heldout.items()},
                        gate=gate if isinstance(gate, list) else [], placement=placement)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{ckpt / 'state.json'}: malformed ({type(e).__name__}: {e})") from e


def restore_history(history: Any, ckpt: Path, tokenizer: Any, vocab_size: int) -> None:
    """The checkpoint's history store into the run's ``history``. A missing or damaged store, or
    one recorded under another tokenizer, is discarded inside load (history only accelerates)."""
    from rhymerl.drafting import HistoryStore
    from rhymerl.tokenizer import tokenizer_fingerprint

    history.replace_with(HistoryStore.load(ckpt / "history.json.gz",
                                           tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
                                           vocab_size=vocab_size))
