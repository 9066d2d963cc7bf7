"""``rhymerl bench project``: what HistoSpec, HistoPipe and async RL would do to a whole RL step
on GPU clusters, from the step model of :mod:`rhymerl.bench.step_model`.

A projection, not a measurement: the cost models are built from public figures (listed with
their sources in ``docs/projection.md``), and the sensitivity table shows how the speed-up
moves with the two least certain inputs: the acceptance length of history drafts, and the
tail of the length distribution.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from rhymerl.bench.common import print_table, write_report
from rhymerl.bench.step_model import SCALES, project, sensitivity

ACCEPTS = (1.5, 2.0, 2.5, 3.0, 3.5)
SIGMAS = (0.4, 0.8, 1.2)


def run(json_path: str | None = None, *, quick: bool = False) -> dict[str, Any]:
    t = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for scale in SCALES.values():
        rows += project(scale)
    print("projected step (a model, not a measurement; assumptions in docs/projection.md)")
    print_table(rows, ["scale", "variant", "step_s", "speedup", "rollout_share", "bubble_fraction",
                       "rollout_s", "train_s", "sync_s"])
    sens: list[dict[str, Any]] = []
    for scale in SCALES.values():
        sens += sensitivity(scale, ACCEPTS[1::2] if quick else ACCEPTS, SIGMAS[:2] if quick else SIGMAS)
    print("\nsensitivity: speed-up of everything combined (and of HistoSpec alone) over the baseline,"
          " by tokens per verification forward and by the tail (sigma of typical lengths across prompts)")
    print_table(sens, ["scale", "sigma", "accept", "speedup_all", "speedup_histospec"])
    print(f"({time.perf_counter() - t:.0f} s)")
    return write_report(rows, json_path, {"sensitivity": sens,
                                           "scales": {k: asdict(s) for k, s in SCALES.items()}})
