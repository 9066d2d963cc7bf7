"""TRL's ``GRPOTrainer`` (vLLM colocate mode) drafting with HistoSpec, against the same run without.

Nothing in TRL is patched: the engine TRL builds gets HistoSpec from ``RHYMERL_HISTOSPEC`` and its
weight pushes work through rhymerl's ``vllm.general_plugins`` (:mod:`rhymerl.vllm.env_switch`,
:mod:`rhymerl.vllm.direct_weights`). A variant is a set of those variables, so each run is a
process of its own (vLLM reads its plugins once per process); the variants take turns, in an order
that alternates from round to round, because this machine's speed drifts within minutes.

Per step it records TRL's own figures (step time, reward, the largest log-prob gap between vLLM
and the trainer) beside vLLM's speculative counters and the time spent in generation.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from rhymerl.bench.common import print_table, write_report
from rhymerl.vllm.counters import spec_counters
from rhymerl.vllm.env_switch import CONFIG, DTYPE, SWITCH

DRAFT_TOKENS = 8
# What each variant sets; every variant runs vLLM in float32, as the trainer does.
VARIANTS: dict[str, dict[str, str]] = {
    "plain": {},
    "histospec": {SWITCH: str(DRAFT_TOKENS)},
    # Siblings (a prompt's other samples in flight) as a draft source turned off: what HistoSpec
    # drafts from in the first epoch, before the prompt has a history.
    "histospec_no_siblings": {SWITCH: str(DRAFT_TOKENS), CONFIG: json.dumps(
        {"speculative": {"sources": ["prompt_history", "global_history", "ngram"]}})},
}


@dataclass(frozen=True)
class TrlRun:
    """One TRL training run: the policy (an HF folder, or a named model such as ``smollm2``), the
    task, and how much work a step does."""
    model: str
    task: str = "arith"
    prompts: int = 16  # the dataset: every prompt comes back once an epoch
    batch_prompts: int = 4  # prompts a step (x generations completions)
    generations: int = 4
    epochs: int = 3
    max_tokens: int = 96
    max_model_len: int = 256  # vLLM's, prompt and completion
    temperature: float = 1.0
    top_p: float = 1.0
    lr: float = 1e-5
    seed: int = 0


def completion_text(c: Any) -> str:
    """A completion as TRL passes it: text, or a chat turn ``[{"role": ..., "content": ...}]``."""
    return c[-1]["content"] if isinstance(c, list) else str(c)


def train_once(run: TrlRun, out_dir: str) -> list[dict[str, Any]]:
    """One GRPOTrainer run in this process; a row per step."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rhymerl.config import load_config
    from rhymerl.data.splits import task_splits
    from rhymerl.model.gguf import resolve_model
    from rhymerl.tasks import get_task

    task = get_task(run.task)
    data = load_config(None, [f"model.path={run.model}", f"data.task={run.task}", f"data.num_train={run.prompts}",
                              "data.num_val=0"]).data
    rows = task_splits(data, run.seed)[0]
    dataset = Dataset.from_list([{"prompt": r.prompt, "ground_truth": r.ground_truth} for r in rows])
    path = str(resolve_model(run.model))

    def reward(prompts, completions, ground_truth, **_):
        return [task.score(completion_text(c), g) for c, g in zip(completions, ground_truth)]

    steps: list[dict[str, Any]] = []
    per_epoch = max(1, run.prompts // run.batch_prompts)

    class Record(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.counters = time.perf_counter(), spec_counters(trainer.vllm_generation.llm)
            timer.seconds, timer.tokens = 0.0, 0

        def on_step_end(self, args, state, control, **kw):
            drafts, accepted = spec_counters(trainer.vllm_generation.llm)
            steps.append({"step": state.global_step, "epoch": 1 + (state.global_step - 1) // per_epoch,
                          "step_s": time.perf_counter() - self.t0, "gen_s": timer.seconds,
                          "gen_tokens": timer.tokens, "drafts": drafts - self.counters[0],
                          "accepted": accepted - self.counters[1]})

    cfg = GRPOConfig(output_dir=out_dir, use_cpu=True, bf16=False, gradient_checkpointing=False,
                     per_device_train_batch_size=run.batch_prompts * run.generations,
                     num_generations=run.generations, max_completion_length=run.max_tokens,
                     temperature=run.temperature, top_p=run.top_p, learning_rate=run.lr, beta=0.0,
                     num_train_epochs=run.epochs, logging_steps=1, report_to="none", save_strategy="no",
                     seed=run.seed, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
                     vllm_max_model_length=run.max_model_len)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), reward_funcs=reward, args=cfg,
                          train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(path),
                          callbacks=[Record()])
    timer = GenerationTimer(trainer.vllm_generation)
    trainer.train()
    logged = {r["step"]: r for r in trainer.state.log_history if "reward" in r}
    for row in steps:
        log = logged.get(row["step"], {})
        row["reward"] = log.get("reward")
        row["logp_gap_max"] = log.get("sampling/sampling_logp_difference/max")
    return steps


class GenerationTimer:
    """Seconds and completion tokens of the generation calls one TRL vLLM backend makes."""

    def __init__(self, generation: Any) -> None:
        self.seconds, self.tokens = 0.0, 0
        inner = generation.generate

        def generate(*args: Any, **kwargs: Any):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            self.seconds += time.perf_counter() - t0
            self.tokens += sum(len(ids) for ids in out[1])
            return out

        generation.generate = generate


def by_epoch(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One run's steps summed per epoch: acceptance length (vLLM's: 1 + accepted per draft)."""
    out = []
    for epoch in sorted({s["epoch"] for s in steps}):
        rows = [s for s in steps if s["epoch"] == epoch]
        drafts, accepted = sum(r["drafts"] for r in rows), sum(r["accepted"] for r in rows)
        out.append({"epoch": epoch, "step_s": sum(r["step_s"] for r in rows), "gen_s": sum(r["gen_s"] for r in rows),
                    "gen_tokens": sum(r["gen_tokens"] for r in rows),
                    "acceptance_length": 1 + accepted / drafts if drafts else None,
                    "reward": float(np.mean([r["reward"] for r in rows if r["reward"] is not None] or [np.nan])),
                    "logp_gap_max": max((r["logp_gap_max"] or 0.0) for r in rows)})
    return out


def spread(values: list[float]) -> str:
    """median [min, max]"""
    return f"{np.median(values):.3g} [{min(values):.3g}, {max(values):.3g}]"


def summarize(runs: dict[str, list[list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """A row per variant and epoch over the rounds. Generation's speed-up is in tokens a second
    against plain in the same round: runs sample different responses, of other lengths."""
    epochs = {v: [by_epoch(r) for r in rs] for v, rs in runs.items()}
    table = []
    for variant, rounds in epochs.items():
        for i, first in enumerate(rounds[0]):
            cells = [r[i] for r in rounds]
            row = {"variant": variant, "epoch": first["epoch"],
                   "acceptance_length": spread([c["acceptance_length"] or 1.0 for c in cells]),
                   "gen_s": spread([c["gen_s"] for c in cells]),
                   "gen_tok_s": spread([c["gen_tokens"] / c["gen_s"] for c in cells]),
                   "step_s": spread([c["step_s"] for c in cells]),
                   "reward": spread([c["reward"] for c in cells]),
                   "logp_gap_max": max(c["logp_gap_max"] for c in cells)}
            if "plain" in epochs and variant != "plain":
                plain = [r[i] for r in epochs["plain"]]
                row["gen_speedup"] = spread([(c["gen_tokens"] / c["gen_s"]) / (p["gen_tokens"] / p["gen_s"])
                                             for p, c in zip(plain, cells)])
                row["step_speedup"] = spread([p["step_s"] / c["step_s"] for p, c in zip(plain, cells)])
            table.append(row)
    return table


def run_variant(run: TrlRun, variant: str, work: Path) -> list[dict[str, Any]]:
    """One run in a child process with the variant's environment."""
    out = work / f"{variant}-{time.monotonic_ns()}.json"
    env = {**{k: v for k, v in os.environ.items() if k not in (SWITCH, CONFIG)}, DTYPE: "float32",
           **VARIANTS[variant]}
    cmd = [sys.executable, "-m", "rhymerl.bench.trl_histospec", "--one", json.dumps(asdict(run)), "--out", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"TRL run ({variant}) failed with exit code {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def run(json_path: str | None = None, *, quick: bool = False, model: str | None = None, rounds: int = 5,
        variants: tuple[str, ...] = ("plain", "histospec"), **settings: Any) -> dict[str, Any]:
    """Each variant once a round, for ``rounds`` rounds; tables by epoch."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown TRL variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
    if model is None:
        from rhymerl.config import load_config
        from rhymerl.training.sft import ensure_base_model

        model = str(ensure_base_model(load_config()))
    run_cfg = replace(TrlRun(model=model), **settings)
    if quick:
        rounds = 1
    runs: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as work:
        for r in range(rounds):
            for v in (variants if r % 2 == 0 else variants[::-1]):
                t0 = time.perf_counter()
                runs[v].append(run_variant(run_cfg, v, Path(work)))
                print(f"round {r + 1}/{rounds} {v}: {time.perf_counter() - t0:.0f}s", flush=True)
    table = summarize(runs)
    print(f"TRL GRPOTrainer, vLLM colocate, {run_cfg.model}: {run_cfg.prompts} prompts x {run_cfg.generations}, "
          f"{run_cfg.batch_prompts} prompts a step, {run_cfg.epochs} epochs; {rounds} rounds, median [min, max]")
    print_table(table, ["variant", "epoch", "acceptance_length", "gen_s", "gen_tok_s", "gen_speedup", "step_s",
                        "step_speedup",
                        "reward", "logp_gap_max"])
    return write_report(table, json_path, {"settings": asdict(run_cfg), "rounds": rounds, "runs": runs})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--one", required=True, help="a TrlRun as JSON: one run in this process")
    p.add_argument("--out", required=True, help="where its steps go (JSON)")
    ns = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as out_dir:
        steps = train_once(TrlRun(**json.loads(ns.one)), out_dir)
    Path(ns.out).write_text(json.dumps(steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
