"""What every ``rhymerl bench ...`` shares: the JSON shape and a description of the machine."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rhymerl.device import machine_info


def write_report(rows: list[dict[str, Any]], path: str | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"rows": [...], "machine": {...}}`` plus ``extra``, written to ``path`` when given."""
    report = {"rows": rows, "machine": machine_info(), **(extra or {})}
    if path:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
    return report


def paired_ratio(ours: list[float], base: list[float], name: str, digits: int | None = None) -> dict[str, float]:
    """``ours`` over ``base`` round by round (both timed in the same round, one after the other, so
    the machine's drift falls on both): the median and range of the per-round ratios, as the
    columns ``name``, ``name_lo`` and ``name_hi``."""
    got = sorted(a / b for a, b in zip(ours, base))
    cols = {name: float(np.median(got)), name + "_lo": got[0], name + "_hi": got[-1]}
    return cols if digits is None else {k: round(v, digits) for k, v in cols.items()}


def print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).rjust(w) for c, w in zip(cols, widths)))


def bootstrap_interval(samples: np.ndarray, stat: Callable[[np.ndarray], float], reps: int = 1000,
                       seed: int = 0) -> str:
    """A 95 % bootstrap interval of ``stat`` over ``samples`` (rows resampled whole, so paired
    measurements stay paired), as ``"lo-hi"``: how well the rows pin the figure down."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(samples), size=(reps, len(samples)))
    boot = np.array([stat(samples[i]) for i in idx])
    return f"{np.percentile(boot, 2.5):.3f}-{np.percentile(boot, 97.5):.3f}"
