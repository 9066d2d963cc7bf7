"""Per-prompt response-length prediction from the history store."""
from __future__ import annotations

from typing import Callable

import numpy as np

STATS: dict[str, Callable[[np.ndarray], float]] = {
    "mean": lambda a: float(a.mean()),
    "median": lambda a: float(np.median(a)),
    "max": lambda a: float(a.max()),
    "p75": lambda a: float(np.quantile(a, 0.75)),
}


def predict_lengths(history: list[list[int]], stat: str = "mean") -> np.ndarray:
    """One predicted response length per prompt from its previous responses' lengths.

    ``history[i]`` holds prompt i's previous lengths (empty: no history). A prompt without
    history gets the median prediction of the prompts that have one (the batch's
    distribution); with no history at all every prompt gets the same value, which makes a
    length-aware plan fall back to an even one.
    """
    if stat not in STATS:
        raise ValueError(f"length stat {stat!r} is not one of {sorted(STATS)}")
    f = STATS[stat]
    pred = np.array([f(np.asarray(h, dtype=np.float64)) if len(h) else np.nan for h in history], dtype=np.float64)
    known = ~np.isnan(pred)
    pred[~known] = float(np.median(pred[known])) if known.any() else 1.0
    return pred


def predicted_samples(history: list[list[int]], n: list[int], stat: str = "mean") -> list[list[float]]:
    """Per prompt, ``n[i]`` predicted sample lengths: the prompt's previous lengths as a
    distribution (n evenly spaced quantiles, so both the total and the longest are
    predicted), re-centred on ``stat``; a prompt without history gets ``n`` copies of the
    batch's median prediction."""
    point = predict_lengths(history, stat)
    out = []
    for h, k, p in zip(history, n, point):
        if len(h):
            a = np.asarray(h, dtype=np.float64)
            q = np.quantile(a, (np.arange(k) + 0.5) / k)
            base = STATS[stat](a)
            out.append((q * (p / base) if base > 0 else q).tolist())
        else:
            out.append([float(p)] * k)
    return out


def log_error_sigma(predicted: np.ndarray | list[float], true_means: np.ndarray | list[float]) -> float:
    """How far prompts' mean lengths moved from their predictions: the RMS of
    log(true / predicted) (0 with fewer than two prompts)."""
    p = np.maximum(1.0, np.asarray(predicted, dtype=np.float64))
    t = np.maximum(1.0, np.asarray(true_means, dtype=np.float64))
    if len(p) < 2:
        return 0.0
    return float(np.sqrt(np.mean(np.log(t / p) ** 2)))


def spearman(a: np.ndarray | list[float], b: np.ndarray | list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if len(a) < 2:
        return float("nan")

    def ranks(x: np.ndarray) -> np.ndarray:
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        # average the ranks of ties
        _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
        sums = np.bincount(inv, weights=r)
        return sums[inv] / counts[inv]

    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])
