"""Which placement HistoPipe uses, learnt from the steps already run.

A placement is judged on what happened, not on what the predictions say would happen: after a
step, each candidate's plan is rebuilt from that step's *predictions* and simulated on its
*actual* lengths. Judging plans on lengths drawn from the predictions favours the plans that
trust them most (docs/design.md has the measurement); an outcome cannot be fooled that way. The placement
with the lowest recent makespan relative to the step's best is used next, with tail migration
or without (migration reads the predictions too: where they carry nothing it moves the wrong
samples); before any step has been seen, least-loaded routing's deal, without migration, which
knows nothing of lengths and so cannot be misled by them. A placement that reads the predictions
replaces the better of the two deals that know nothing of lengths (least-loaded's, and even
split's contiguous runs of prompts, whose siblings share a worker) only when it finished clearly
faster than that one, by more than the simulator's own measured error: the spread, across
the workers of a step just run, of each worker's measured busy time over the simulator's for
its share (machine-wide drift cancels within a step; what remains is how far the simulator can
misjudge one share against another, which is what ranking placements rests on). Where the two
deals themselves score within that error, even split's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rhymerl.scheduling.cost import StepCost

COLD_START = ("least_loaded", False)
SIBLINGS_TOGETHER = ("even", False)
KNOWLEDGE_FREE = (COLD_START, SIBLINGS_TOGETHER)  # the deals no prediction can mislead


@dataclass
class PlacementScores:
    """Per candidate placement, an exponential moving average of its simulated makespan on past
    steps' actual lengths, relative to the best candidate of that step (1.0: the best)."""

    decay: float = 0.7
    # Another placement replaces the knowledge-free deal only when it finished that much faster
    # (relative makespan) on the recent steps: where predictions carry little, placements differ
    # by less than a step's noise, and the one that ignores them is the safe choice.
    margin: float = 0.02
    scores: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    # moving mean of the squared spread of log(measured / simulated) busy time across a step's
    # workers; None before any step was measured
    share_error_sq: float | None = None

    @property
    def share_error(self) -> float:
        """The simulator's measured error between one worker's share and another's (0: unknown)."""
        return math.sqrt(self.share_error_sq) if self.share_error_sq is not None else 0.0

    @property
    def trusted_margin(self) -> float:
        """How much faster, relative, a placement must score to replace the knowledge-free deal."""
        return max(self.margin, self.share_error)

    def choose(self) -> tuple[str, bool]:
        """The placement to use next, and whether with tail migration."""
        free = [(self.scores[_key(*c)], c) for c in KNOWLEDGE_FREE if _key(*c) in self.scores]
        if not free:
            return COLD_START
        base, baseline = min(free)
        if len(free) == 2 and max(free)[0] - base <= self.trusted_margin:
            # Too close for the simulator to call: even split, whose siblings share a worker, their
            # prompt's prefill and prefix cache, and draft from each other (what the simulator
            # prices in part or not at all; docs/design.md).
            baseline = SIBLINGS_TOGETHER
        best = min(self.scores, key=lambda key: self.scores[key])
        if self.scores[best] > base - self.trusted_margin:  # within what the simulator can tell apart: the baseline
            return baseline
        name, moves = best.split("+")
        return name, moves == "migrate"

    def observe(self, predicted: list[list[float]], actual: list[list[int]], num_workers: int, *, cost: StepCost,
                max_num_seqs: int, prompt_len: float, error_sigma: float, max_tokens: float | None,
                candidates: tuple[str, ...] | None = None, cores: float | None = None,
                threads: int = 1) -> dict[str, float]:
        """Score every candidate (with and without tail migration) on one finished step; returns
        this step's relative makespans. ``cores``, ``threads``: as :func:`simulate`'s (workers
        sharing a machine's cores)."""
        from rhymerl.scheduling.plan import Plan
        from rhymerl.scheduling.planner import PLACEMENTS, placement_groups
        from rhymerl.scheduling.simulator import simulate

        names = candidates or tuple(p for p in PLACEMENTS if p != "auto")
        groups = placement_groups(predicted, num_workers, names, cost=cost, max_num_seqs=max_num_seqs,
                                  prompt_len=prompt_len, error_sigma=error_sigma, max_tokens=max_tokens)
        means = np.array([float(np.mean(x)) if len(x) else 0.0 for x in predicted])
        made = {}
        for name, workers in groups.items():
            for moves in (True, False):
                p = Plan("histopipe", workers, migrate=moves, predicted=means)
                made[_key(name, moves)] = simulate(p, actual, int(round(prompt_len)), cost, max_num_seqs=max_num_seqs,
                                                   cores=cores, threads=threads).makespan_s
        best = min(made.values())
        rel = {key: m / best if best > 0 else 1.0 for key, m in made.items()}
        for key, r in rel.items():
            old = self.scores.get(key)
            self.scores[key] = r if old is None else self.decay * old + (1 - self.decay) * r
        self.steps += 1
        return rel

    def observe_shares(self, measured_busy_s: list[float], simulated_busy_s: list[float]) -> float | None:
        """Record how well the simulator priced each worker's share of a step just run (busy
        seconds measured and simulated, per worker); returns this step's spread (None: fewer
        than two workers did work)."""
        logs = [math.log(m / s) for m, s in zip(measured_busy_s, simulated_busy_s) if m > 0 and s > 0]
        if len(logs) < 2:
            return None
        mean = sum(logs) / len(logs)
        spread_sq = sum((x - mean) ** 2 for x in logs) / (len(logs) - 1)
        old = self.share_error_sq
        self.share_error_sq = spread_sq if old is None else self.decay * old + (1 - self.decay) * spread_sq
        return math.sqrt(spread_sq)


def _key(placement: str, migrate: bool) -> str:
    return f"{placement}+{'migrate' if migrate else 'static'}"
