"""How many tokens per row to verify: the width whose expected tokens per second is highest.

Scoring ``k`` drafted tokens per row costs ``cost(B, k+1) / cost(B, 1)`` times a plain
decode step; it yields on average ``1 + f(k)`` tokens per row with ``f(k) = a + a^2 + ...
+ a^k`` for a per-token acceptance ``a``. Large early batches are compute-bound and
speculate little; the drained long tail speculates a lot.
"""
from __future__ import annotations

import bisect
from collections import Counter

from rhymerl.engine.cost_model import CostModel

CANDIDATES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def expected_accepted(alpha: float, k: int) -> float:
    if k <= 0:
        return 0.0
    if alpha >= 1.0:
        return float(k)
    return alpha * (1 - alpha**k) / (1 - alpha)


def best_width(cost: CostModel | None, lengths: list[int], alpha: float, max_k: int,
               overhead: float = 1.0, draft_s: float = 0.0) -> int:
    """The per-row draft cap ``k`` that maximises tokens per second for drafts of ``lengths``
    (one per row).

    ``overhead`` scales the cost of a speculative step relative to a plain one beyond what
    the forward alone costs (tree bookkeeping, verification), as measured online; ``draft_s``
    is the drafting work still to be done for this step, in seconds (0 once drafts exist).
    """
    counts = Counter(lengths)
    B = len(lengths)
    if cost is None or not B:
        return max_k
    top = max(counts)
    # f(m) for every draft length once. gain(k) = B + sum over rows of f(min(k, n)): rows no
    # longer than k add f(n) (prefix sums over the sorted lengths), the others f(k) each.
    f = [0.0]
    power = 1.0
    for _ in range(min(top, max_k)):  # f(m) = a + a^2 + ... + a^m, as expected_accepted
        power *= alpha
        f.append(f[-1] + power)
    ns = sorted(counts)
    sum_f, sum_c = [0.0], [0]
    for n in ns:
        sum_f.append(sum_f[-1] + f[min(n, max_k)] * counts[n])
        sum_c.append(sum_c[-1] + counts[n])
    best_k, best_rate = 0, B / cost.cost(B, 1)
    for k in CANDIDATES:
        if k == 0 or k > max_k:
            continue
        j = bisect.bisect_right(ns, k)
        gain = B + sum_f[j] + (f[k] * (B - sum_c[j]) if j < len(ns) else 0.0)
        rate = gain / (cost.cost(B, min(k, top) + 1) * overhead + draft_s)
        if rate > best_rate * 1.02:  # a margin: do not speculate for a rounding error
            best_k, best_rate = k, rate
    return best_k


def uniform_width(cost: CostModel | None, B: int, n: int, alpha: float, max_k: int, overhead: float = 1.0,
                  draft_s: float = 0.0) -> int:
    """:func:`best_width` for ``B`` rows whose drafts are all ``n`` long (the same answer).

    The gate asks this before drafting, on every step; most steps of a first epoch then skip,
    and a step that skips must cost next to nothing, so this is a few operations per candidate
    (no per-row work): beyond ``n`` tokens a wider cap gains nothing, so the search stops there."""
    if cost is None or not B:
        return max_k
    best_k, best_rate = 0, B / cost.cost(B, 1)
    f, power, m = 0.0, 1.0, 0  # f(m) = a + a^2 + ... + a^m
    for k in CANDIDATES:
        if k == 0:
            continue
        if k > max_k:
            break
        depth = k if k < n else n
        while m < depth:
            m += 1
            power *= alpha
            f += power
        rate = (B + f * B) / (cost.cost(B, depth + 1) * overhead + draft_s)
        if rate > best_rate * 1.02:  # the same margin as best_width
            best_k, best_rate = k, rate
        if k >= n:
            break
    return best_k
