"""Two-sample tests for "these samples come from the same distribution": how losslessness is
checked on an engine that is not ours (where tokens cannot be compared bit for bit).

Under the null hypothesis (speculation changes nothing) every p-value here is uniform; a
lossy verifier shows as a tiny one. Pure torch: no SciPy."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import torch


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df)."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_homogeneity(a: Counter, b: Counter, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Chi-square test that two samples of categories share one distribution; cells whose
    expected count is under ``min_expected`` in either sample are pooled into one. Returns
    ``(statistic, degrees of freedom, p-value)``."""
    na, nb = sum(a.values()), sum(b.values())
    if na == 0 or nb == 0:
        return 0.0, 0, 1.0
    cells, rare = [], [0, 0]
    for k in set(a) | set(b):
        ca, cb = a.get(k, 0), b.get(k, 0)
        tot = ca + cb
        if min(tot * na, tot * nb) / (na + nb) < min_expected:
            rare[0] += ca
            rare[1] += cb
        else:
            cells.append((ca, cb))
    if sum(rare):
        cells.append((rare[0], rare[1]))
    if len(cells) < 2:
        return 0.0, 0, 1.0
    stat = 0.0
    for ca, cb in cells:
        tot = ca + cb
        for obs, n in ((ca, na), (cb, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    df = len(cells) - 1
    return stat, df, chi2_sf(stat, df)


def mean_pvalue(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p-value that two samples share a mean (Welch's z, large samples)."""
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    if len(ta) < 2 or len(tb) < 2:
        return 1.0
    se = math.sqrt(float(ta.var()) / len(ta) + float(tb.var()) / len(tb))
    if se == 0:
        return 1.0 if float(ta.mean()) == float(tb.mean()) else 0.0
    z = abs(float(ta.mean() - tb.mean())) / se
    return math.erfc(z / math.sqrt(2))


@dataclass
class SameDistribution:
    """The tests comparing two sets of responses to the same prompts (``p``: the smallest
    p-value times the number of tests, a Bonferroni bound)."""

    p_tokens: float  # chi-square on the tokens at each of the first positions (min over positions x positions)
    p_length: float  # mean response length
    p_reward: float  # mean reward (accuracy), when rewards are given
    n_a: int
    n_b: int

    @property
    def p(self) -> float:
        return min(1.0, 3 * min(self.p_tokens, self.p_length, self.p_reward))


def same_distribution(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]], *, positions: int = 8,
                      rewards_a: Sequence[float] | None = None,
                      rewards_b: Sequence[float] | None = None) -> SameDistribution:
    """Compare responses ``a`` and ``b`` (token lists, drawn for the same prompts in the same
    numbers): per-position token distributions over the first ``positions`` output tokens
    (where drafts start), response lengths, and rewards."""
    ps = []
    for j in range(positions):
        _, _, p = chi2_homogeneity(Counter(r[j] for r in a if len(r) > j), Counter(r[j] for r in b if len(r) > j))
        ps.append(p)
    p_tokens = min(1.0, positions * min(ps)) if ps else 1.0
    p_length = mean_pvalue([len(r) for r in a], [len(r) for r in b])
    p_reward = mean_pvalue(list(rewards_a), list(rewards_b)) if rewards_a is not None and rewards_b is not None else 1.0
    return SameDistribution(p_tokens, p_length, p_reward, len(a), len(b))


def goodness_of_fit(counts: Counter, probs: dict, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Chi-square test that ``counts`` were drawn from the known distribution ``probs`` (an
    exact check: no second sample's noise); cells expected under ``min_expected`` pooled, and
    a category outside ``probs`` is impossible, so it alone rejects. Returns
    ``(statistic, degrees of freedom, p-value)``."""
    n = sum(counts.values())
    if n == 0:
        return 0.0, 0, 1.0
    if any(k not in probs and c for k, c in counts.items()):
        return math.inf, 1, 0.0
    cells, rare = [], [0.0, 0.0]
    for k, p in probs.items():
        exp, obs = p * n, counts.get(k, 0)
        if exp < min_expected:
            rare[0] += obs
            rare[1] += exp
        else:
            cells.append((obs, exp))
    if rare[1] > 0:
        cells.append((rare[0], rare[1]))
    if len(cells) < 2:
        return 0.0, 0, 1.0
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return stat, len(cells) - 1, chi2_sf(stat, len(cells) - 1)


def combined_fit(tests: Sequence[tuple[float, int, float]]) -> float:
    """One p-value for independent goodness-of-fit tests (their statistics and degrees of
    freedom added: a chi-square again)."""
    stat, df = sum(t[0] for t in tests), sum(t[1] for t in tests)
    return 0.0 if math.isinf(stat) else chi2_sf(stat, df)
