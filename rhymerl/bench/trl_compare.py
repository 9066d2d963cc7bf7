"""TRL's ``GRPOTrainer`` against our RL step on the same work (optional extra: ``trl``).

Same tiny model (a ``transformers`` copy of the base), same prompts, group size, completion
length, learning rate and optimizer, no KL; seconds per step after a warm-up step.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def run_trl(base: str, prompts: int, n: int, max_tokens: int, lr: float, steps: int, temperature: float,
            seed: int) -> float:
    """Median seconds per GRPOTrainer step (after the first)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rhymerl.config import load_config
    from rhymerl.data.splits import task_splits
    from rhymerl.tasks import get_task

    task = get_task("arith")
    rows = task_splits(load_config().data, seed)[0][: prompts * steps]
    ds = Dataset.from_list([{"prompt": r.prompt, "ground_truth": r.ground_truth} for r in rows])

    def reward(prompts, completions, ground_truth, **_):
        return [task.score(c, g) for c, g in zip(completions, ground_truth)]

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, use_cpu=True, bf16=False, gradient_checkpointing=False,
                         per_device_train_batch_size=prompts * n, num_generations=n,
                         max_completion_length=max_tokens, learning_rate=lr, beta=0.0, temperature=temperature,
                         max_steps=steps, logging_steps=1, report_to="none", save_strategy="no", seed=seed)
        trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(base), reward_funcs=reward, args=cfg,
                              train_dataset=ds, processing_class=AutoTokenizer.from_pretrained(base),
                              callbacks=[Clock()])
        trainer.train()
    return float(np.median(times[1:]))


def run_ours(base: str, prompts: int, n: int, max_tokens: int, lr: float, steps: int, temperature: float,
             seed: int) -> float:
    from rhymerl.config import load_config
    from rhymerl.training.metrics.logger import read_metrics
    from rhymerl.training.rl import train

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [f"model.path={base}", f"trainer.batch_prompts={prompts}", f"rollout.n={n}",
                                 f"rollout.max_tokens={max_tokens}", f"trainer.lr={lr}", f"trainer.steps={steps}",
                                 "algorithm.kl_coef=0", "algorithm.dynamic_sampling=false",  # TRL's work: every group,
                                 "trainer.ppo_mini_batches=1",  # and one update per generation
                                 f"rollout.temperature={temperature}", f"seed={seed}",
                                 "trainer.save_every=1000", f"trainer.eval_every={steps + 1}",
                                 f"trainer.output_dir={out}", "data.num_val=0"])
        train(cfg, progress=False)
        rows = [r for r in read_metrics(Path(out) / "metrics.jsonl") if "timing_s/step" in r]
    return float(np.median([r["timing_s/step"] for r in rows[1:]]))


def compare(base: str, *, prompts: int = 16, n: int = 8, max_tokens: int = 160, lr: float = 2e-4, steps: int = 4,
            temperature: float = 0.7, seed: int = 0) -> list[dict[str, Any]]:
    kw = dict(prompts=prompts, n=n, max_tokens=max_tokens, lr=lr, steps=steps, temperature=temperature, seed=seed)
    # Two rounds in A-B-B-A order, best of each side: the runs are seconds long, but this
    # machine's speed drifts, and a fixed order would put that drift into the ratio.
    trl_s = run_trl(base, **kw)
    ours_s = min(run_ours(base, **kw), run_ours(base, **kw))
    trl_s = min(trl_s, run_trl(base, **kw))
    work = f"{prompts} prompts x {n} samples, <= {max_tokens} tokens"
    return [{"variant": "trl", "step_s": trl_s, "work": work, "speedup": 1.0},
            {"variant": "ours_same_work", "step_s": ours_s, "work": work, "speedup": trl_s / ours_s}]
