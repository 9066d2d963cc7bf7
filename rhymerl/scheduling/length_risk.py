"""Response lengths as distributions, and what a group of samples costs under them.

A prompt's samples in one step are exchangeable: any of them may be the long one. So a plan
should not assign a prompt's predicted quantiles to particular samples; each sample carries
the prompt's whole distribution. Modelled here as a log-normal per prompt: the log-mean and
log-spread of its previous lengths, plus a prompt-level error (how far a prompt's mean moved
between epochs, measured on the last step) shared by all its samples, clipped at the
request's ``max_tokens``.

A worker's decode time is about ``base * longest + per_seq * total`` (see
:func:`rhymerl.scheduling.planner.estimate_s`): the longest sample is a max, and a max is
sub-additive, so risky samples are cheapest *together* on lightly loaded workers, and the
total carries the error of every prompt in the group. :class:`GroupTime` prices a contiguous
run of samples with a high quantile of its longest and the total plus ``k`` standard
deviations, each in O(grid) from prefix sums, so a planner can binary-search cuts.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import log, sqrt
from typing import Callable

import numpy as np
import torch

from rhymerl.scheduling.cost import StepCost

@dataclass(frozen=True)
class LengthDists:
    """Per prompt: log-normal response lengths (``mu``, ``sigma`` of log length within the
    prompt), a shared prompt-level log error ``error_sigma``, and the clip ``max_tokens``."""

    mu: np.ndarray
    sigma: np.ndarray
    error_sigma: float
    max_tokens: float

    @classmethod
    def from_samples(cls, lengths: list[list[float]], error_sigma: float, max_tokens: float | None = None
                     ) -> "LengthDists":
        """From per-prompt predicted sample lengths (e.g. the quantiles of its history).

        ``error_sigma`` is measured on observed means, so it also holds their sampling noise,
        which the within-prompt spread models again. Kept whole on purpose: taking it out
        (the unbiased choice for a log-normal) made placements worse on the heavy-tailed
        traces, whose tail the log-normal understates (bench pipe, 256 workers: 301 s vs 293 s)."""
        logs = [np.log(np.maximum(1.0, np.asarray(x, dtype=np.float64))) if len(x) else np.zeros(1)
                for x in lengths]
        mu = np.array([v.mean() for v in logs])
        sigma = np.array([v.std() for v in logs])
        top = max((max(x) for x in lengths if len(x)), default=1.0)
        return cls(mu, sigma, float(error_sigma), float(max_tokens or max(top * 4.0, 1.0)))

    @property
    def total_sigma(self) -> np.ndarray:
        """Spread of one sample's log length around the prediction."""
        return np.sqrt(self.sigma ** 2 + self.error_sigma ** 2)

    def mean(self) -> np.ndarray:
        """Expected length of one sample of each prompt."""
        s = self.total_sigma
        return np.minimum(self.max_tokens, np.exp(self.mu + s * s / 2))

    def risk(self, z: float = 1.0) -> np.ndarray:
        """A prompt's ranking key: the log length ``z`` spreads above its centre."""
        return self.mu + z * self.total_sigma

    def draw(self, n: list[int], rng: np.random.Generator) -> list[list[int]]:
        """One step's lengths as the model expects them (prompt error shared by its samples)."""
        shift = rng.normal(0.0, self.error_sigma, size=len(self.mu)) if self.error_sigma > 0 else np.zeros(len(self.mu))
        out = []
        for p, k in enumerate(n):
            x = np.exp(self.mu[p] + shift[p] + self.sigma[p] * rng.standard_normal(k))
            out.append(np.clip(x, 1, self.max_tokens).astype(int).tolist())
        return out


class GroupTime:
    """Estimated decode time of samples ``units[a:b]`` on one worker, for any a < b in O(grid).

    Args:
        dists: the prompts' length distributions.
        unit_prompt: the prompt of each sample, in the order groups are cut from.
        n: samples per prompt, indexed by prompt (its prompt-level error is shared by that many).
        cost: the worker's step-time curve.
        max_num_seqs: slots per worker (past them samples queue: steps >= total / slots).
        prompt_len: prompt tokens per distinct prompt (prefill).
        q: the quantile of the group's longest sample that is priced.
        k: standard deviations of the group's total added to its mean.
        grid: points of the log-length grid the longest sample's distribution is kept on.
    """

    def __init__(self, dists: LengthDists, unit_prompt: np.ndarray, n: np.ndarray, cost: StepCost, max_num_seqs: int,
                 prompt_len: float = 0.0, *, q: float = 0.97, k: float = 2.0, grid: int = 96) -> None:
        self.cost, self.slots, self.prompt_len = cost, max_num_seqs, prompt_len
        self.log_q, self.k = log(q), k
        up = np.asarray(unit_prompt, dtype=np.int64)
        s = dists.total_sigma
        self.grid = np.exp(np.linspace(0.0, np.log(max(2.0, dists.max_tokens)), grid))
        # log P(L <= x) per prompt on the grid; the clip makes the last point certain
        z = (np.log(self.grid)[None, :] - dists.mu[:, None]) / np.maximum(s, 1e-6)[:, None]
        cdf = 0.5 * (1.0 + torch.special.erf(torch.from_numpy(z / sqrt(2.0))).numpy())  # vectorised
        cdf[:, -1] = 1.0
        log_cdf = np.log(np.maximum(cdf, 1e-300))
        mean = dists.mean()
        within_var = mean ** 2 * np.expm1(dists.sigma ** 2)
        # the prompt-level error moves all its samples together: n times one sample's share
        shared_var = mean ** 2 * np.expm1(dists.error_sigma ** 2) * np.asarray(n, dtype=np.float64)
        first = np.ones(len(up), dtype=bool)  # where a run of one prompt's samples starts
        first[1:] = up[1:] != up[:-1]
        # Prefix sums of log P(L <= x) over the units, kept per run (units come prompt by prompt):
        # the sum up to unit i is its run's start plus i's offset in the run times the prompt's
        # row, so memory and time scale with prompts, not samples.
        starts = np.flatnonzero(first)
        lengths = np.diff(np.append(starts, len(up)))
        rows = log_cdf[up[starts]]
        self._run_prompt_cdf = np.vstack([rows, np.zeros((1, grid))])
        self._run_cdf = np.vstack([np.zeros((1, grid)), np.cumsum(lengths[:, None] * rows, axis=0)])
        self._run_start = np.append(starts, len(up))
        self._run_of = np.append(np.repeat(np.arange(len(starts)), lengths), len(starts))
        self._sum = np.concatenate([[0.0], np.cumsum(mean[up])])
        self._var = np.concatenate([[0.0], np.cumsum((within_var + shared_var)[up])])
        self._first = first
        self._prompts = np.concatenate([[0], np.cumsum(first)])
        self.size = len(up)

    def _cdf_at(self, i: int) -> np.ndarray:
        r = self._run_of[i]
        return self._run_cdf[r] + (i - self._run_start[r]) * self._run_prompt_cdf[r]

    def __call__(self, a: int, b: int) -> float:
        if b <= a:
            return 0.0
        log_p = self._cdf_at(b) - self._cdf_at(a)
        longest = self.grid[min(int(np.searchsorted(log_p, self.log_q)), len(self.grid) - 1)]
        total = self._sum[b] - self._sum[a] + self.k * sqrt(max(0.0, self._var[b] - self._var[a]))
        count = b - a
        steps = longest if count <= self.slots else max(longest, total / self.slots)
        prompts = self._prompts[b] - self._prompts[a] + (0 if self._first[a] else 1)  # distinct, for prefill
        prefill = self.prompt_len * (prompts if count <= self.slots else count)
        c = self.cost
        return c.base_s * steps + c.per_seq_s * total + c.prefill_per_token_s * prefill


def smallest_budget(cut: Callable[[float], list[int] | None], lo: float, hi: float, fallback: list[int],
                    iters: int = 50, rtol: float = 1e-6) -> list[int]:
    """Binary search for the smallest budget whose ``cut`` fits (``cut`` returns None when it
    needs more groups than there are workers), to ``rtol`` of it; returns that cut."""
    best = cut(hi) or fallback
    for _ in range(iters):
        if hi - lo <= rtol * hi:
            break
        mid = (lo + hi) / 2
        c = cut(mid)
        if c is None:
            lo = mid
        else:
            best, hi = c, mid
    return best


def cut_at_budget(est: Callable[[int, int], float], size: int, R: int, budget: float) -> list[int] | None:
    """Contiguous groups of ``size`` ranked units, each taking units while ``est(a, b)`` (monotone
    in b) stays within ``budget`` (at least one unit): the boundaries (first 0, last ``size``);
    None when that needs more than R groups. Each group's end is searched from the last group's
    size outward (neighbours in a ranking take similar sizes: a few calls, not log2 of the rest)."""
    bounds, a, guess = [0], 0, 1
    while a < size:
        b = _last_within(est, a, size, budget, guess)
        guess = b - a
        a = b
        bounds.append(a)
        if len(bounds) - 1 > R:
            return None
    return bounds


def _last_within(est: Callable[[int, int], float], a: int, size: int, budget: float, guess: int) -> int:
    """The largest b in (a, size] with ``est(a, b) <= budget`` (a + 1 when none is): a galloping
    search from ``a + guess``, then bisection of the bracket it found."""
    lo = a + 1  # fits, or is the answer anyway
    if est(a, lo) > budget:
        return lo
    hi = size  # the answer is in [lo, hi]
    g = min(size, max(lo, a + guess))
    if est(a, g) <= budget:
        lo, step = g, 1
        while lo < hi:
            c = min(hi, lo + step)
            if est(a, c) > budget:
                hi = c - 1
                break
            lo, step = c, step * 2
    else:
        hi, step = g - 1, 1
        while hi > lo:
            c = max(lo, hi - step)
            if est(a, c) <= budget:
                lo = c
                break
            hi, step = c - 1, step * 2
    while lo < hi:
        m = (lo + hi + 1) // 2
        if est(a, m) <= budget:
            lo = m
        else:
            hi = m - 1
    return lo


def cut_contiguous(est, size: int, R: int, iters: int = 40) -> list[int]:
    """Cut ``size`` ranked units into at most R contiguous groups minimising the largest
    ``est(a, b)`` (monotone in b): a binary search on the budget, each group's end found by
    :func:`cut_at_budget`. Returns the boundaries (first 0, last ``size``), then splits
    the slowest group while workers are spare (allocation: long work gets them)."""
    if size == 0:
        return [0, 0]
    lo = max(est(i, i + 1) for i in range(0, size, max(1, size // 512)))
    # To 1e-6 of the budget: the priced times are a proxy, and cuts from a budget 0.1 % off can
    # lengthen the simulated step by percents (docs/design.md, HistoPipe).
    best = smallest_budget(lambda budget: cut_at_budget(est, size, R, budget), lo, est(0, size), [0, size], iters)
    while len(best) - 1 < R:
        times = [est(best[g], best[g + 1]) for g in range(len(best) - 1)]
        g = int(np.argmax(times))
        a, b = best[g], best[g + 1]
        if b - a < 2:
            break
        lo, hi = a + 1, b - 1  # the split where the two halves balance
        while lo < hi:
            m = (lo + hi) // 2
            if est(a, m) < est(m, b):
                lo = m + 1
            else:
                hi = m
        best.insert(g + 1, lo)
    return best


__all__ = ["LengthDists", "GroupTime", "cut_at_budget", "cut_contiguous", "smallest_budget"]
