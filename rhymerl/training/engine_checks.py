"""Checks of a rollout engine other than ours against the trainer, every step: an engine that
samples with other weights or numerics than the trainer's trains off-policy without a word,
so the run stops at the first step that shows it."""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# The default limit on the largest log-prob gap of a step, by the engines' dtype: above healthy
# steps' worst and below a partly synced engine's (float32's chosen from runs: docs/design.md);
# bfloat16/float16's catches a stale engine only, not numerics drift.
DEFAULT_MAX_LOGP_GAP = {"float32": 1e-2, "bfloat16": 2.0, "float16": 2.0}


class LogpGapError(RuntimeError):
    """The rollout engine's sampling log-probs are not the trainer's."""


def max_logp_gap(configured: float | None, dtype: str) -> float:
    """The limit in force: the configured one, else the dtype's default (0: not enforced)."""
    return DEFAULT_MAX_LOGP_GAP.get(dtype, 2.0) if configured is None else configured


def check_logp_gap(gap_max: float, limit: float, step: int, engine: str) -> None:
    if limit > 0 and gap_max > limit:
        raise LogpGapError(
            f"step {step}: {engine}'s sampling log-probs differ from the trainer's by up to {gap_max:.3g} on the same "
            f"tokens (rollout.max_logp_gap={limit:g}); likely a weight sync that did not reach every layer, or the "
            "engines' numerics apart (dtype, kernels). The run stopped before training on it; `--resume` continues "
            "from the last checkpoint (rollout.max_logp_gap may be raised there, or 0 to log only)")


class DrafterHealth:
    """``spec/health``: a step's accepted tokens per forward over its trailing mean (the last
    ``window`` steps). Drafts gone bad (stale draft weights after a sync or a wake-up, a drafter
    fed the wrong states) show as a collapse towards 1 token per forward while the policy moves
    slowly: below ``collapse`` for ``patience`` steps in a row gives one warning."""

    def __init__(self, window: int = 10, collapse: float = 0.5, patience: int = 3) -> None:
        self.window, self.collapse, self.patience = window, collapse, patience
        self.trail: list[float] = []
        self.low = 0
        self.warned = False

    def update(self, accepted_per_forward: float, step: int) -> float:
        mean = sum(self.trail) / len(self.trail) if self.trail else accepted_per_forward
        health = accepted_per_forward / mean if mean > 0 else 1.0
        # below half of what drafting gave (tokens beyond the one a forward always makes)
        self.low = self.low + 1 if self.trail and mean > 1.0 and health < self.collapse else 0
        if self.low >= self.patience and not self.warned:
            self.warned = True
            log.warning(
                "step %d: speculation collapsed: %.2f accepted tokens per forward against a trailing mean of %.2f "
                "for %d steps (spec/health %.2f); draft weights stale after a sync, or drafts from the wrong states?",
                step, accepted_per_forward, mean, self.low, health)
        if self.low == 0:  # a collapsed stretch does not lower the bar it is judged by
            self.trail = (self.trail + [accepted_per_forward])[-self.window:]
        return health
