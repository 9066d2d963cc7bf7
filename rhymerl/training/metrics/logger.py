"""Per-step metrics: ``metrics.jsonl``, TensorBoard event files, PNG plots, and the length
trace ``traces.jsonl``."""
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


def append_trace(path: Path, step: int, batch: Any, kept: Any) -> None:
    """Per-sample lengths of a step's groups (a ``ScoredRollout`` and what the filter kept of
    it, ``KeptBatch``): what `bench pipe` replays."""
    trained = {id(o) for o in kept.outs}
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "keys": [row.key for row in batch.rows], "predicted": batch.predicted,
                            "prompt_lens": [len(o.prompt_token_ids) for o in batch.outs],
                            "lengths": [[len(c.token_ids) for c in o.outputs] for o in batch.outs],
                            "forwards": [[c.num_forwards for c in o.outputs] for o in batch.outs],
                            # which groups the update trained on (DAPO's filter drops the rest)
                            "trained": [id(o) in trained for o in batch.outs],
                            "gen_s": kept.gen_s}) + "\n")


def truncate_trace(path: Path, last: int) -> None:
    """On resume: drop the trace of steps after ``last`` (they will be redone)."""
    if path.exists():
        rewrite_jsonl(path, [t for t in read_jsonl(path) if t.get("step", 0) <= last])


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (a last line torn by a kill is dropped with a warning)."""
    return read_jsonl(path)


def plot_run(run_dir: Path) -> list[Path]:
    """Reward/accuracy, response length, rollout time split and speculation acceptance per step."""
    # The object API on an Agg canvas: no pyplot (its import and backend switch cost more than
    # the drawing), and a fixed layout instead of tight_layout (a second full draw).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = read_metrics(run_dir / "metrics.jsonl")
    if not rows:
        return []
    steps = [r["step"] for r in rows]

    def series(key: str) -> tuple[list[int], list[float]]:
        pts = [(r["step"], r[key]) for r in rows if key in r]
        return [p[0] for p in pts], [p[1] for p in pts]

    out = []
    fig = Figure(figsize=(11, 7.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    fig.subplots_adjust(left=0.06, right=0.94, bottom=0.07, top=0.95, wspace=0.22, hspace=0.3)
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
    # stacked areas: one polygon per part, where bars drew one rectangle per step and part
    ax.stackplot(steps, *[[r.get(k, 0.0) for r in rows] for k in parts], labels=[k.split("/")[1] for k in parts],
                 step="mid")
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
    p = run_dir / "plots.png"
    fig.savefig(p, dpi=110)
    out.append(p)
    return out
