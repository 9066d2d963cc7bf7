"""A finished run's summary: ``summary.json`` and the lines printed at the end."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from rhymerl.atomic_io import atomic_write_text
from rhymerl.device import machine_info
from rhymerl.engine.llm_engine import accepted_per_forward
from rhymerl.training.metrics.logger import read_metrics


def paired_gain(before: list[float], after: list[float], *, reps: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Held-out accuracy before and after on the same prompts, the gain, and its 95 % interval
    from a paired bootstrap over prompts (each resample takes a prompt's before and after together)."""
    b, a = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    diff = a - b
    idx = np.random.default_rng(seed).integers(0, len(diff), size=(reps, len(diff)))
    boot = diff[idx].mean(axis=1)
    return {"before": float(b.mean()), "after": float(a.mean()), "delta": float(diff.mean()),
            "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))], "n": int(len(diff))}


def reward_rise(scores: list[float], window: int = 20) -> dict[str, float]:
    """Mean training reward of the first and the last ``window`` steps (a quarter of a shorter run)."""
    w = max(1, min(window, len(scores) // 4))
    first, last = float(np.mean(scores[:w])), float(np.mean(scores[-w:]))
    return {"first": first, "last": last, "rise": last - first, "window": w}


def summarize(run_dir: Path, wall_s: float,
              heldout: tuple[dict[str, list[float]], dict[str, list[float]]]) -> dict[str, Any]:
    """The run's summary; ``heldout``: per-prompt held-out scores (greedy, sampled) before and after."""
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "timing_s/step" in r]
    if not rows:
        return {}

    def total(k: str) -> float:
        return float(sum(r.get(k, 0.0) for r in rows))

    steps_s = total("timing_s/step")
    return {
        "steps": len(rows),
        "wall_s": wall_s,
        "time_split": {k.split("/")[1]: round(total(k) / steps_s, 3) for k in
                       ("timing_s/gen", "timing_s/reward", "timing_s/old_logp", "timing_s/update", "timing_s/sync")},
        # from summed counts, so both figures describe the same thing
        "spec_accepted_per_forward": accepted_per_forward(total("spec/decode_rows"),
                                                          total("spec/decode_tokens") - total("spec/decode_rows")),
        "spec_forwards_per_token": total("spec/decode_rows") / max(1.0, total("spec/decode_tokens")),
        "final_score": rows[-1]["critic/score/mean"],
        "train_reward": reward_rise([r["critic/score/mean"] for r in rows]),
        "heldout": {kind: paired_gain(heldout[0][kind], heldout[1][kind]) for kind in ("greedy", "sampled")
                    if kind in heldout[0] and kind in heldout[1]
                    and len(heldout[0][kind]) == len(heldout[1][kind]) > 0},
    }


def print_summary(s: dict[str, Any], run_dir: Path) -> None:
    if not s:
        return
    print(f"\nrun: {run_dir}  ({s['steps']} steps, {s['wall_s']:.0f}s)")
    for kind, what in (("greedy", "greedy accuracy"), ("sampled", "sampled accuracy (avg@4)")):
        h = s.get("heldout", {}).get(kind)
        if h:
            lo, hi = h["ci95"]
            print(f"held-out {what}: {100 * h['before']:.1f}% -> {100 * h['after']:.1f}% "
                  f"({100 * h['delta']:+.1f}, 95% CI {100 * lo:+.1f}..{100 * hi:+.1f}, {h['n']} prompts)")
    tr = s.get("train_reward")
    if tr:
        print(f"train reward (mean of the first/last {tr['window']} steps): {tr['first']:.2f} -> {tr['last']:.2f} "
              f"({tr['rise']:+.2f})")
    print("time split: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in s["time_split"].items()))
    print(f"speculation: {s['spec_accepted_per_forward']:.2f} tokens per sequence per forward "
          f"(= {1 / max(s['spec_forwards_per_token'], 1e-9):.2f}x fewer target forwards per token); "
          f"`rhymerl bench e2e` measures the wall-clock speed-up against no speculation")
    if s.get("base_short"):
        print(f"WARNING: {s['base_short']}")
    for p in s.get("plots", []):
        print(f"plots: {p}")


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """``summary.json``, written whole, with the machine it ran on (exactness holds per CPU model,
    torch build and thread count)."""
    summary["machine"] = machine_info()
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
