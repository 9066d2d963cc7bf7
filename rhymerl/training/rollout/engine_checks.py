"""Checks of a rollout engine other than ours against the trainer, every step: an engine that
samples with other weights or numerics than the trainer's trains off-policy without a word,
so the run stops at the first step that shows it."""
from __future__ import annotations

import logging
import math
from typing import Callable, Sequence

import torch

log = logging.getLogger(__name__)

# The default limit on the largest log-prob gap of a step, by the engines' dtype: above healthy
# steps' worst and below a partly synced engine's (0.57-0.66 measured with one stale layer).
# float32's chosen from runs (docs/design.md); the 16-bit ones are a bound, not yet measured on
# a GPU: 8 (bf16) or 11 (fp16) mantissa bits round logits of |z| <= 32 by at most 0.125, a
# log-softmax moves by at most twice that, so 0.4 leaves room above numerics and below a stale layer.
DEFAULT_MAX_LOGP_GAP = {"float32": 1e-2, "bfloat16": 0.4, "float16": 0.4}
CHECKED_RESPONSES = 64  # responses of a step whose log-probs the check recomputes (spread over the batch)
_CHUNK = 8  # responses per forward (bounds the logits' memory for a large vocabulary)


class LogpGapError(RuntimeError):
    """The rollout engine's sampling log-probs are not the trainer's."""


def max_logp_gap(configured: float | None, dtype: str) -> float:
    """The limit in force: the configured one, else the dtype's default (0: not enforced)."""
    return DEFAULT_MAX_LOGP_GAP.get(dtype, 0.4) if configured is None else configured


def check_logp_gap(gap_max: float, limit: float, step: int, engine: str) -> None:
    if limit > 0 and not gap_max <= limit:  # NaN fails too: log-probs missing or broken
        raise LogpGapError(
            f"step {step}: {engine}'s sampling log-probs differ from the trainer's by up to {gap_max:.3g} on the same "
            f"tokens (rollout.max_logp_gap={limit:g}); likely a weight sync that did not reach every layer, or the "
            "engines' numerics apart (dtype, kernels). The run stopped before training on it; `--resume` continues "
            "from the last checkpoint (rollout.max_logp_gap may be raised there, or 0 to log only)")


def checked_responses(n: int, k: int = CHECKED_RESPONSES) -> list[int]:
    """Which of a step's ``n`` responses the check reads: all up to ``k``, else ``k`` spread
    evenly over the batch (kept and filtered groups alike: the check never depends on rewards)."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def logp_gap(token_logp: Callable[[torch.Tensor], torch.Tensor], prompts: Sequence[list[int]],
             responses: Sequence[list[int]], sampled: Sequence[list[float]], pad_id: int,
             device: torch.device | str = "cpu") -> dict[str, float]:
    """The largest and mean gap between the engine's sampling log-probs (``sampled``, one per
    response token) and ``token_logp(ids)`` (the trainer's next-token log-probs of each row of
    ``ids``, under the weights that drew the responses), and how many tokens were compared.
    Nothing compared is NaN, never 0: a gap of exactly 0 must mean two equal engines."""
    gaps = []
    for lo in range(0, len(responses), _CHUNK):
        ps, rs, ls = prompts[lo: lo + _CHUNK], responses[lo: lo + _CHUNK], sampled[lo: lo + _CHUNK]
        width = max(len(p) + len(r) for p, r in zip(ps, rs))
        ids = torch.full((len(rs), width), pad_id, dtype=torch.long)
        for i, (p, r) in enumerate(zip(ps, rs)):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        with torch.no_grad():
            ours = token_logp(ids.to(device)).float().cpu()
        for i, (p, r, lp) in enumerate(zip(ps, rs, ls)):
            if len(lp) != len(r):
                raise ValueError(f"response {lo + i}: the engine returned {len(lp)} log-probs for {len(r)} tokens")
            if r:
                gaps.append((ours[i, len(p) - 1: len(p) + len(r) - 1] - torch.tensor(lp, dtype=torch.float32)).abs())
    if not gaps:
        return {"rollout/logp_gap_max": math.nan, "rollout/logp_gap_mean": math.nan, "rollout/logp_gap_tokens": 0}
    g = torch.cat(gaps)
    g = torch.where(torch.isnan(g), torch.full_like(g, math.inf), g)  # a missing log-prob is a failure
    return {"rollout/logp_gap_max": float(g.max()), "rollout/logp_gap_mean": float(g.mean()),
            "rollout/logp_gap_tokens": int(g.numel())}


class DrafterHealth:
    """``spec/health``: a step's drafted-and-accepted tokens per forward (accepted tokens per
    forward less the one every forward makes) over their trailing mean (the last ``window``
    healthy steps). Drafts gone bad (stale draft weights after a sync or a wake-up, a drafter
    fed the wrong states) collapse towards 0 while the policy moves slowly: below ``collapse``
    for ``patience`` steps in a row gives one warning. Collapsed steps stay out of the trail,
    so a collapse never lowers the bar it is judged by."""

    def __init__(self, window: int = 10, collapse: float = 0.5, patience: int = 3, min_gain: float = 0.1) -> None:
        self.window, self.collapse, self.patience, self.min_gain = window, collapse, patience, min_gain
        self.trail: list[float] = []  # drafted-and-accepted tokens per forward of healthy steps
        self.low = 0
        self.warned = False

    def update(self, accepted_per_forward: float, step: int) -> float:
        gain = max(0.0, accepted_per_forward - 1.0)
        mean = sum(self.trail) / len(self.trail) if self.trail else gain
        health = gain / mean if mean > 0 else 1.0
        # judged only once drafting has paid (a first epoch drafts next to nothing: no bar yet)
        collapsed = bool(self.trail) and mean >= self.min_gain and health < self.collapse
        self.low = self.low + 1 if collapsed else 0
        if self.low >= self.patience and not self.warned:
            self.warned = True
            log.warning(
                "step %d: speculation collapsed: %.2f accepted tokens per forward against a trailing mean of %.2f "
                "for %d steps (spec/health %.2f); draft weights stale after a sync, or drafts from the wrong states?",
                step, accepted_per_forward, 1.0 + mean, self.low, health)
        if not collapsed:
            self.trail = (self.trail + [gain])[-self.window:]
        return health
