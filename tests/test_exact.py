"""Bit-exact rollouts with ``invariant`` numerics: no tie allowance anywhere.

The logits of a position are the same bits in a prefill, a decode, a path or a tree
verification, at any batch size; so speculation on or off, any worker count and a kill at
any moment give the same tokens and the same learning metrics. Off (``invariant=False``),
the float results move with the batch (the first test shows it), which is why the older
tests of this suite avoided near-ties.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from rhymerl.config import load_config
from rhymerl.engine import SamplingParams
from rhymerl.llm import LLM
from rhymerl.training.checkpoint import latest_checkpoint
from rhymerl.training.metrics.logger import read_metrics

from tests.helpers import learning_metrics, rl_overrides, tiny_model

PROMPTS = [[3 + (i * 7) % 30, 4 + i % 5, 5 + (i * 3) % 11] + [6 + (i * j) % 20 for j in range(i % 9)]
           for i in range(24)]


def _gen(model, *, batch: int, spec: dict | None, invariant: bool, dtype: str = "float32", **sp) -> list:
    llm = LLM(model, max_num_seqs=batch, max_model_len=96, invariant=invariant, dtype=dtype, speculative=spec)
    params = SamplingParams(n=2, max_tokens=40, seed=5, logprobs=True, ignore_eos=True, **sp)
    return [(c.token_ids, c.logprobs) for o in llm.generate(PROMPTS, params, use_tqdm=False) for c in o.outputs]


def test_without_invariance_the_logprobs_move_with_the_batch():
    m = tiny_model(std=0.1)
    a = _gen(m, batch=64, spec=None, invariant=False, temperature=1.0)
    b = _gen(m, batch=3, spec=None, invariant=False, temperature=1.0)
    assert [x[1] for x in a] != [x[1] for x in b]  # the reason for invariant numerics


SETTINGS = [("float32", dict(temperature=0.7)), ("float32", dict(temperature=1.0)), ("float32", dict(temperature=1.3)),
            ("float32", dict(temperature=1.0, top_p=0.9, top_k=20)), ("float32", dict(temperature=0.0)),
            ("bfloat16", dict(temperature=1.0)), ("bfloat16", dict(temperature=0.7, top_p=0.9, top_k=20))]


@pytest.mark.parametrize("dtype,sp", SETTINGS, ids=["t0.7", "t1.0", "t1.3", "topp-topk", "greedy", "bf16-t1.0",
                                                    "bf16-topp-topk"])
def test_invariant_tokens_and_logprobs_at_any_batch_with_or_without_drafts(dtype, sp):
    m = tiny_model(std=0.1)
    ref = _gen(m, batch=64, spec=None, invariant=True, dtype=dtype, **sp)
    for batch, spec in [(3, None), (16, None),
                        (64, {"method": "ngram", "index_draft_tokens": 6, "gate": False}),
                        (5, {"method": "ngram", "index_draft_tokens": 6, "gate": True}),
                        (64, {"method": "ngram", "index_draft_tokens": 6, "tree_budget": 8, "gate": False}),
                        (7, {"method": "history", "index_draft_tokens": 6, "tree_budget": 8, "gate": True})]:
        got = _gen(m, batch=batch, spec=spec, invariant=True, dtype=dtype, **sp)
        assert got == ref, (batch, spec)  # tokens and log-probs, bit for bit


def test_invariant_logits_same_in_prefill_decode_and_verification():
    """The logits of one position computed four ways: a prefill of the whole sequence, a
    prefill then 1-token decodes, a decode scoring a path of drafts, and a tree whose branch
    holds the sequence (beside a sibling branch)."""
    from rhymerl.engine.kv_cache import KVCache
    from rhymerl.model import CacheView
    from rhymerl.model.invariant import invariant_forward

    m = tiny_model(std=0.1)
    seq = [3, 9, 4, 12, 7, 7, 20, 5, 11]
    P = 5  # prompt; positions P..8 are the "drafted" tokens
    cache = KVCache(m.config, 4, 128, torch.device("cpu"), torch.float32)

    def fwd(slot: int, ids: list[int], pos: list[int], write: list[int], key_pos=None) -> torch.Tensor:
        B, T = 1, len(ids)
        view = CacheView(cache.k[:, slot:slot + 1], cache.v[:, slot:slot + 1], torch.tensor([write]),
                         torch.ones(B, 1, T, max(write) + 1, dtype=torch.bool))
        with torch.inference_mode():
            return invariant_forward(m, torch.tensor([ids]), torch.tensor([pos]), view, key_pos=key_pos)[0]

    whole = fwd(0, seq, list(range(9)), list(range(9)))
    fwd(1, seq[:P], list(range(P)), list(range(P)))
    steps = [fwd(1, [seq[t]], [t], [t])[0] for t in range(P, 9)]
    fwd(2, seq[:P], list(range(P)), list(range(P)))
    path = fwd(2, seq[P:], list(range(P, 9)), list(range(P, 9)))
    # tree: node 0 = seq[P] (root), nodes 1-2 a wrong sibling branch, nodes 3.. the true branch
    fwd(3, seq[:P], list(range(P)), list(range(P)))
    tokens = [seq[P], 30, 31, seq[P + 1], seq[P + 2], seq[P + 3]]
    parents = [-1, 0, 1, 0, 3, 4]
    depth = [0, 1, 2, 1, 2, 3]
    from rhymerl.engine.acceptance import ancestors
    from rhymerl.engine.model_runner import _logical_keys

    anc = ancestors(torch.tensor([parents]), 3)
    kp = _logical_keys(torch.tensor([P]), anc, torch.tensor([depth]), 3, P + len(tokens))
    tree = fwd(3, tokens, [P + d for d in depth], list(range(P, P + len(tokens))), key_pos=kp)
    for t in range(P, 9):
        assert torch.equal(whole[t], steps[t - P])
        assert torch.equal(whole[t], path[t - P])
    for node, t in [(0, P), (3, P + 1), (4, P + 2), (5, P + 3)]:
        assert torch.equal(tree[node], whole[t]), node


# --- in the RL loop --------------------------------------------------------------------------------
EXACT = ["rollout.invariant=true", "trainer.steps=6", "trainer.eval_every=3"]  # 6 prompts, 4 a step: 4 epochs


@pytest.mark.slow
@pytest.mark.parametrize("temperature,extra", [("0.7", []), ("1.0", []), ("1.3", []),
                                               ("1.0", ["rollout.top_p=0.9", "rollout.top_k=20"])],
                         ids=["t0.7", "t1.0", "t1.3", "topp-topk"])
def test_rl_speculation_on_off_identical(base_model, tmp_path, temperature, extra):
    from rhymerl.training.rl import train

    common = EXACT + [f"rollout.temperature={temperature}", *extra]
    train(load_config(None, rl_overrides(base_model, tmp_path / "off") + common
                      + ["rollout.speculative.method=none"]), progress=False)
    ref = learning_metrics(tmp_path / "off")
    # Ungated, so drafts are made and verified whatever this machine's costs say (the gate, which
    # charges drafting time, may rightly skip them on a tiny model); the gate never changes tokens.
    variants = {"path": ["rollout.speculative.gate=false"]}
    if temperature == "1.0" and not extra:
        variants["tree"] = ["rollout.speculative.tree_budget=8"]
    for name, ov in variants.items():
        train(load_config(None, rl_overrides(base_model, tmp_path / name) + common + ov), progress=False)
        got = learning_metrics(tmp_path / name)
        assert got == ref, name
    steps = [r for r in read_metrics(tmp_path / "path" / "metrics.jsonl") if "spec/decode_tokens" in r]
    assert sum(r["spec/decode_tokens"] - r["spec/decode_rows"] for r in steps[2:]) > 0  # drafts were accepted


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "ray"])
def test_rl_one_and_two_workers_identical(base_model, tmp_path, backend):
    from rhymerl.training.rl import train

    if backend == "ray":
        pytest.importorskip("ray")
    threads = ["rollout.threads=1"]  # part of what exactness holds for: every engine alike
    train(load_config(None, rl_overrides(base_model, tmp_path / "one") + EXACT + threads), progress=False)
    train(load_config(None, rl_overrides(base_model, tmp_path / "two") + EXACT + threads
                      + ["rollout.workers=2", f"rollout.backend={backend}"]), progress=False)
    assert learning_metrics(tmp_path / "two") == learning_metrics(tmp_path / "one")
    rows = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert rows[1]["pipe/workers"] == 2
    if backend == "ray":
        import ray

        ray.shutdown()


@pytest.mark.slow
def test_rl_sigkill_at_a_random_moment_and_resume_identical(base_model, tmp_path):
    """kill -9 of `rhymerl train` somewhere after its first checkpoint, then --resume: the run
    matches the straight one. The hybrid trains a draft head online, whose weights and optimizer
    resume with the run (its loss is a learning metric)."""
    from rhymerl.training.rl import train

    steps = EXACT + ["rollout.speculative.method=hybrid"]
    train(load_config(None, rl_overrides(base_model, tmp_path / "ref") + steps), progress=False)
    run = tmp_path / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rhymerl.cli", "train", *rl_overrides(base_model, run), *steps],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and latest_checkpoint(run) is None:
        time.sleep(0.01)
    time.sleep(random.Random(os.getpid()).uniform(0.0, 0.6))  # somewhere in a later step
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    subprocess.run([sys.executable, "-m", "rhymerl.cli", "train", "--resume", str(run)], check=True,
                   stdout=subprocess.DEVNULL, env=env)
    assert learning_metrics(run) == learning_metrics(tmp_path / "ref")


def test_gate_state_travels_in_checkpoints(base_model, tmp_path):
    """The speculation gate (acceptance estimate, measured overheads, draft fill, the cost model
    measured at start-up) is saved with each checkpoint and restored into the workers."""
    import json

    from rhymerl.training.rl import RLRun, train

    cfg = load_config(None, rl_overrides(base_model, tmp_path / "run") + ["trainer.steps=2", "trainer.eval_every=100"])
    train(cfg, progress=False)
    saved = json.loads((latest_checkpoint(tmp_path / "run") / "state.json").read_text())["gate"]
    assert saved and saved[0]["cost"] and saved[0]["acceptance"] and saved[0]["overhead"]["spec"] is not None
    run = RLRun(cfg, tmp_path / "run", progress=False)
    try:
        fresh = run.rollout.pool.gate_states()
        assert fresh != saved  # a fresh run has learnt nothing yet
        run.resume()
        assert json.loads(json.dumps(run.rollout.pool.gate_states())) == saved
    finally:
        run.close()
