"""Per-step metrics: ``metrics.jsonl``, TensorBoard event files, and PNG plots."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rhymerl.atomic_io import read_jsonl, rewrite_jsonl


class MetricsLogger:
    def __init__(self, run_dir: Path, *, tensorboard: bool = True) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(run_dir / "tensorboard"))
            except Exception:  # noqa: BLE001 - metrics must never stop a run
                self.writer = None

    def truncate_after(self, step: int) -> None:
        """On resume: drop lines of steps after the checkpoint (they will be redone)."""
        if self.path.exists():
            rewrite_jsonl(self.path, [r for r in read_jsonl(self.path) if r.get("step", 0) <= step])

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **metrics}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.writer.add_scalar(k, v, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (a last line torn by a kill is dropped with a warning)."""
    return read_jsonl(path)


def plot_run(run_dir: Path) -> list[Path]:
    """Reward/accuracy, response length, rollout time split and speculation acceptance per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir / "metrics.jsonl")
    if not rows:
        return []
    steps = [r["step"] for r in rows]

    def series(key: str) -> tuple[list[int], list[float]]:
        pts = [(r["step"], r[key]) for r in rows if key in r]
        return [p[0] for p in pts], [p[1] for p in pts]

    out = []
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0, 0]
    ax.plot(*series("critic/score/mean"), label="train reward (mean)")
    xs, ys = series("val/accuracy")
    ax.plot(xs, ys, "o-", label="held-out greedy accuracy")
    xs, ys = series("val/accuracy_sampled")
    if xs:
        ax.plot(xs, ys, "s--", label="held-out sampled accuracy (avg@4)")
    ax.set_title("reward and accuracy")
    ax.set_xlabel("step")
    ax.legend(fontsize="small")
    ax = axes[0, 1]
    ax.plot(*series("response_length/mean"), label="mean")
    ax.plot(*series("response_length/max"), label="max")
    ax.set_title("response length (tokens)")
    ax.set_xlabel("step")
    ax.legend()
    ax = axes[1, 0]
    parts = ["timing_s/gen", "timing_s/reward", "timing_s/old_logp", "timing_s/update", "timing_s/sync"]
    bottom = [0.0] * len(steps)
    for k in parts:
        vals = [r.get(k, 0.0) for r in rows]
        ax.bar(steps, vals, bottom=bottom, label=k.split("/")[1])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title("time per step (s)")
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    ax = axes[1, 1]
    ax.plot(*series("spec/accepted_per_forward"), label="tokens per forward (per sequence)")
    ax2 = ax.twinx()
    ax2.plot(*series("spec/acceptance_rate"), color="tab:orange", label="draft acceptance rate")
    ax.set_title("speculation")
    ax.set_xlabel("step")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    p = run_dir / "plots.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    out.append(p)
    return out
