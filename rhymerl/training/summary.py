"""A finished run's summary: ``summary.json`` and the lines printed at the end."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rhymerl.engine.llm_engine import accepted_per_forward
from rhymerl.training.metrics import read_metrics


def summarize(run_dir: Path, initial: dict[str, float] | None, wall_s: float) -> dict[str, Any]:
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "timing_s/step" in r]
    vals = [r for r in read_metrics(run_dir / "metrics.jsonl") if "val/accuracy" in r]
    if not rows:
        return {}

    def total(k: str) -> float:
        return float(sum(r.get(k, 0.0) for r in rows))

    steps_s = total("timing_s/step")
    return {
        "steps": len(rows),
        "accuracy_before": (initial or {}).get("val/accuracy"),
        "accuracy_after": vals[-1]["val/accuracy"] if vals else None,
        "sampled_accuracy_before": (initial or {}).get("val/accuracy_sampled"),
        "sampled_accuracy_after": vals[-1].get("val/accuracy_sampled") if vals else None,
        "wall_s": wall_s,
        "time_split": {k.split("/")[1]: round(total(k) / steps_s, 3) for k in
                       ("timing_s/gen", "timing_s/reward", "timing_s/old_logp", "timing_s/update", "timing_s/sync")},
        # from summed counts, so both figures describe the same thing
        "spec_accepted_per_forward": accepted_per_forward(total("spec/decode_rows"),
                                                          total("spec/decode_tokens") - total("spec/decode_rows")),
        "spec_forwards_per_token": total("spec/decode_rows") / max(1.0, total("spec/decode_tokens")),
        "final_score": rows[-1]["critic/score/mean"],
    }


def print_summary(s: dict[str, Any], run_dir: Path) -> None:
    if not s:
        return
    b, a = s["accuracy_before"], s["accuracy_after"]
    print(f"\nrun: {run_dir}  ({s['steps']} steps, {s['wall_s']:.0f}s)")
    if b is not None and a is not None:
        print(f"held-out greedy accuracy: {100 * b:.1f}% -> {100 * a:.1f}% ({100 * (a - b):+.1f} points)")
    sb, sa = s.get("sampled_accuracy_before"), s.get("sampled_accuracy_after")
    if sb is not None and sa is not None:
        print(f"held-out sampled accuracy (avg@4 at the rollout temperature): {100 * sb:.1f}% -> {100 * sa:.1f}% "
              f"({100 * (sa - sb):+.1f} points)")
    print("time split: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in s["time_split"].items()))
    print(f"speculation: {s['spec_accepted_per_forward']:.2f} tokens per sequence per forward "
          f"(= {1 / max(s['spec_forwards_per_token'], 1e-9):.2f}x fewer target forwards per token); "
          f"`rhymerl bench e2e` measures the wall-clock speed-up against no speculation")
    for p in s.get("plots", []):
        print(f"plots: {p}")
