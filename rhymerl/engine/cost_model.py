"""How much one forward pass costs as a function of batch size and tokens scored per row.

Measured on the actual model and device when speculation is switched on (about a second on
a CPU), so the speculation gate decides on this machine's numbers, not on assumptions; once per
process for a given model shape, numerics and cache (:func:`calibrated`).
"""
from __future__ import annotations

import bisect
import time
from typing import Callable, Hashable

import torch

from rhymerl.engine.kv_cache import KVCache
from rhymerl.model import CacheView


class CostModel:
    """``cost(B, T)``: seconds of one forward with ``B`` rows scoring ``T`` tokens each."""

    def __init__(self, table: dict[tuple[int, int], float]) -> None:
        self.table = table
        self.batches = sorted({b for b, _ in table})
        self.widths = sorted({t for _, t in table})
        self._memo: dict[tuple[int, int], float] = {}  # the gate asks the same few (B, T) every step

    def cost(self, B: int, T: int) -> float:
        c = self._memo.get((B, T))
        if c is None:
            c = self._memo[(B, T)] = self._interpolate(B, T)
        return c

    def _interpolate(self, B: int, T: int) -> float:
        def around(xs: list[int], x: int) -> tuple[int, int, float]:
            i = bisect.bisect_left(xs, x)
            if i == 0:
                return xs[0], xs[0], 0.0
            if i >= len(xs):
                return xs[-2] if len(xs) > 1 else xs[-1], xs[-1], 1.0 + (x - xs[-1]) / max(1, xs[-1] - xs[-2]) \
                    if len(xs) > 1 else 1.0
            lo, hi = xs[i - 1], xs[i]
            return lo, hi, (x - lo) / (hi - lo)

        b0, b1, fb = around(self.batches, B)
        t0, t1, ft = around(self.widths, T)

        def get(b: int, t: int) -> float:
            c = self.table.get((b, t))
            if c is not None:
                return c
            known = sorted(tt for (bb, tt) in self.table if bb == b)
            i = bisect.bisect_left(known, t)
            if 0 < i < len(known):  # between two timed widths of a row: linear between them
                lo, hi = known[i - 1], known[i]
                return self.table[(b, lo)] + (self.table[(b, hi)] - self.table[(b, lo)]) * (t - lo) / (hi - lo)
            # outside the measured grid: scale the nearest measured width linearly in tokens
            tt = known[-1] if i else known[0]
            return self.table[(b, tt)] * t / tt

        c0 = get(b0, t0) + (get(b0, t1) - get(b0, t0)) * ft
        c1 = get(b1, t0) + (get(b1, t1) - get(b1, t0)) * ft
        return max(1e-6, c0 + (c1 - c0) * fb)

    def relative(self, B: int, T: int) -> float:
        return self.cost(B, T) / self.cost(B, 1)


# Cost tables measured in this process, by what they depend on (see :func:`calibrated`).
_MEASURED: dict[Hashable, dict[tuple[int, int], float]] = {}


def calibrated(key: Hashable, measure: Callable[[], CostModel]) -> CostModel:
    """``measure()``, once per process for each ``key`` (the model's shape and numerics, the
    device, dtype, thread count and cache): engines built later in the process (a training run
    after another, several ``LLM`` objects, a worker rebuilt after a fault) reuse the table.
    Each measurement costs about a second on a CPU and says the same thing; the gate's online
    check (:class:`rhymerl.drafting.gate_estimates.RealizedCost`) follows the machine's speed from there."""
    table = _MEASURED.get(key)
    if table is None:
        table = _MEASURED[key] = dict(measure().table)
    return CostModel(dict(table))


@torch.inference_mode()
def calibrate(model: Callable[..., torch.Tensor], cache: KVCache, device: torch.device, max_batch: int,
              max_width: int, context: int = 96, budget_tokens: int = 8192, affine_from_s: float = 0.25) -> CostModel:
    """Time forwards (``model(ids, positions, view)``: a :class:`CausalLM` or the engine's
    forward) over a grid of batch sizes and widths, reusing the engine's KV memory.

    A forward that takes ``affine_from_s`` or more is timed twice, not four times or more (a first
    call's own costs are small beside it), and its batch's cost is taken as affine in the width
    from there: only the widest width is timed as well, the ones between are interpolated. A
    large model's start-up is then not spent timing its widest forwards (docs/design.md)."""
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= min(max_batch, cache.num_slots)]
    widths = [t for t in (1, 2, 3, 5, 9, 17, 33) if t <= max_width]
    context = min(context, cache.capacity - max(widths))
    table: dict[tuple[int, int], float] = {}

    def once(ids: torch.Tensor, pos: torch.Tensor, view: CacheView) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        model(ids, pos, view)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    for B in batches:
        row = [T for T in widths if T == 1 or B * T <= budget_tokens]
        affine = False
        for T in row:
            if affine and T != row[-1]:
                continue
            ids = torch.zeros(B, T, dtype=torch.long, device=device)
            pos = (context + torch.arange(T, device=device)).expand(B, T)
            mask = torch.ones(B, 1, T, context + T, dtype=torch.bool, device=device)
            view = CacheView(cache.k[:, :B], cache.v[:, :B], pos, mask)
            first = once(ids, pos, view)  # a warm-up, or half the measurement of a dear forward
            if first >= affine_from_s:  # the lower of two: one interrupted call does not decide
                table[(B, T)], affine = min(first, once(ids, pos, view)), True
                continue
            times: list[float] = []
            while len(times) < 3 or (sum(times) < 0.02 and len(times) < 50):
                times.append(once(ids, pos, view))
            table[(B, T)] = sorted(times)[len(times) // 4]  # a low quantile: robust to interference
    return CostModel(_monotone(table))


def _monotone(table: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """Scoring more tokens, or more rows, never costs less: remove measurement noise that says so."""
    out = dict(table)
    for b in sorted({b for b, _ in out}):
        run = 0.0
        for t in sorted(t for bb, t in out if bb == b):
            run = max(run, out[(b, t)])
            out[(b, t)] = run
    for t in sorted({t for _, t in out}):
        run = 0.0
        for b in sorted(b for b, tt in out if tt == t):
            run = max(run, out[(b, t)])
            out[(b, t)] = run
    return out
