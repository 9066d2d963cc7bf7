"""A rollout step's plan: which worker runs which samples, in what order (what the planner
makes, the simulator replays and the coordinator runs)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class WorkUnit:
    """Some samples of one prompt of the step, run together on one worker."""

    prompt: int
    samples: tuple[int, ...]


@dataclass
class Plan:
    """Per worker, the units it runs in submission order, and what the plan assumed: the
    per-prompt predicted lengths tail migration reads, and which prompts had history."""

    policy: str
    workers: list[list[WorkUnit]]  # per worker, in submission order
    migrate: bool = False  # move tail requests to idle workers at run time
    predicted: np.ndarray | None = field(default=None, repr=False)  # per prompt, what the plan assumed
    known: np.ndarray | None = field(default=None, repr=False)  # per prompt: predicted from its own history
    lengths: list[list[float]] | None = field(default=None, repr=False)  # per prompt, per sample: the plan's input
    placement: str = ""  # how the planner placed the groups (planner.PLACEMENTS; auto's pick, named)

    def samples_per_worker(self) -> list[int]:
        return [sum(len(u.samples) for u in w) for w in self.workers]
