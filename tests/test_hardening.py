"""Hardening: rewards that hang or fail, bad rows, torn files, bad state, Ray authentication.

Each test fails on the behaviour it guards against (a hang, a traceback from deep inside, a
silently different run).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from rhymerl.config import ConfigError, load_config
from rhymerl.data.dataset import DatasetError, PromptRow, parse_row
from rhymerl.data.filters import filter_rows
from rhymerl.data.loader import PromptLoader
from rhymerl.rewards import RewardCall, RewardPool, RewardSpec
from rhymerl.training.checkpoint import latest_checkpoint
from rhymerl.training.metrics.logger import read_metrics

from tests.helpers import learning_metrics, rl_overrides, tiny_model

HANG = """
import time, os
def compute_score(data_source, solution_str, ground_truth, extra_info):
    if extra_info.get("mode") == "hang":
        time.sleep(3600)
    if extra_info.get("mode") == "raise":
        raise ZeroDivisionError("boom")
    if extra_info.get("mode") == "die":
        os._exit(7)
    if extra_info.get("mode") == "thread":
        import threading
        return float(threading.current_thread() is threading.main_thread())
    return 1.0
"""


def _call(mode: str, where: str = "") -> RewardCall:
    return RewardCall("user", "x", "1", {"mode": mode}, where=where or mode)


# --- rewards ---------------------------------------------------------------------------------
def test_reward_pool_bounds_time_and_survives_errors_and_crashes(tmp_path):
    f = tmp_path / "reward.py"
    f.write_text(HANG)
    with RewardPool(RewardSpec(str(f), "compute_score", ("user",)), workers=2, timeout_s=1.0) as pool:
        t = time.perf_counter()
        res = pool.score_many([_call("ok"), _call("hang"), _call("raise"), _call("ok"), _call("die"), _call("ok"),
                               _call("thread")])
        took = time.perf_counter() - t
        assert [r.score for r in res] == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0]  # calls run in the main thread
        assert res[1].timed_out and "timed out" in res[1].error and "reward.timeout_s" in res[1].error
        assert "compute_score" in res[2].error and "ZeroDivisionError: boom" in res[2].error
        assert res[4].error and not res[4].timed_out
        assert pool.timeouts == 1 and pool.crashes == 1
        assert took < 30  # the hanging call cost its timeout, not an hour
        assert [r.score for r in pool.score_many([_call("ok")] * 3)] == [1.0] * 3  # replaced workers serve


def test_reward_pool_refuses_a_reward_file_that_does_not_load(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("import not_a_module_anywhere\n")
    with pytest.raises(RuntimeError, match="not_a_module_anywhere"):
        RewardPool(RewardSpec(str(f), "compute_score", ("user",)))


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _arith_rows(n: int, **extra) -> list[dict]:
    # prompts in the arith base's alphabet (digits, + and =), so the tiny model can encode them
    return [{"prompt": f"{i}+{i + 1}=", "data_source": "user", "reward_model": {"ground_truth": str(2 * i + 1)},
             "extra_info": {"index": i, **extra}} for i in range(n)]


def test_a_hanging_reward_scores_zero_and_the_run_goes_on(base_model, tmp_path):
    from rhymerl.training.rl import train

    f = tmp_path / "reward.py"
    f.write_text(HANG)
    rows = _arith_rows(6)
    rows[2]["extra_info"]["mode"] = "hang"  # one prompt's samples hang, at every visit
    data = _jsonl(tmp_path / "train.jsonl", rows)
    ov = rl_overrides(base_model, tmp_path / "run") + [
        f"data.train_files=[{data}]", f"data.reward_file={f}", "trainer.steps=2", "trainer.eval_every=100",
        "reward.timeout_s=0.5"]
    train(load_config(None, ov), progress=False)
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "timing_s/step" in r]
    assert len(steps) == 2
    assert sum(r["reward/timeouts"] for r in steps) >= 2  # the prompt was in at least one batch
    assert all(r["reward/errors"] == 0 for r in steps)


@pytest.mark.parametrize("name, body, says", [
    ("typo", "return flaot(1)", r"'compute_score'.*typo\.py.*NameError.*flaot"),
    ("nan", "return float('nan')", r"'compute_score'.*nan\.py.*non-finite"),  # NaN turned advantages into NaN
])
def test_a_reward_failing_on_every_row_stops_the_run_naming_it(base_model, tmp_path, name, body, says):
    from rhymerl.training.rl import train
    from rhymerl.training.rollout.phase import RewardFunctionError

    f = tmp_path / f"{name}.py"
    f.write_text(f"def compute_score(data_source, solution_str, ground_truth, extra_info):\n    {body}\n")
    data = _jsonl(tmp_path / "train.jsonl", _arith_rows(6))
    ov = rl_overrides(base_model, tmp_path / "run") + [f"data.train_files=[{data}]", f"data.reward_file={f}",
                                                       "trainer.eval_every=100"]
    with pytest.raises(RewardFunctionError, match=says):
        train(load_config(None, ov), progress=False)
    assert latest_checkpoint(tmp_path / "run") is None  # nothing trained on all-zero rewards


def test_a_non_finite_reward_is_an_error_scored_0_naming_the_function_and_row():
    from rhymerl.rewards import RewardRegistry

    reg = RewardRegistry()
    for bad in (float("nan"), float("inf"), {"score": float("-inf")}):
        reg.register("d", lambda *a, _b=bad: _b, name="bad_fn")
        res = reg.score("d", "x", "1", where="prompt p sample 0")
        assert res.score == 0.0 and "non-finite" in res.error and "bad_fn" in res.error and "prompt p" in res.error


# --- rows --------------------------------------------------------------------------------------
def _char_tok():
    from rhymerl.tokenizer import build_char_tokenizer

    return build_char_tokenizer("0123456789+=")


def _rows(prompts: list[str]) -> list[PromptRow]:
    return [parse_row({"prompt": p, "data_source": "d", "reward_model": {"ground_truth": "1"}},
                      source="train.jsonl", row=i) for i, p in enumerate(prompts)]


def test_overlong_rows_are_dropped_counted_and_named(caplog):
    rows = _rows(["1+1=", "1" * 40, "2+2=", "3" * 33])
    with caplog.at_level(logging.WARNING):
        kept, rep = filter_rows(rows, _char_tok(), max_model_len=48, min_response_tokens=16)
    assert [r.prompt for r in kept] == ["1+1=", "2+2="]
    assert rep.overlong == ["train.jsonl: row 1", "train.jsonl: row 3"]
    assert "train.jsonl: row 1" in caplog.text and "2 overlong" in caplog.text


def test_unencodable_row_is_an_error_naming_file_row_and_characters():
    rows = _rows(["1+1=", "1 + 1 =", "2+2="])
    with pytest.raises(DatasetError, match=r"train\.jsonl: row 1: .*characters .*' '"):
        filter_rows(rows, _char_tok(), max_model_len=48, min_response_tokens=16)
    kept, rep = filter_rows(rows, _char_tok(), max_model_len=48, min_response_tokens=16, skip_bad_rows=True)
    assert len(kept) == 2 and rep.unencodable == ["train.jsonl: row 1"]


def test_a_run_with_a_space_in_a_prompt_stops_before_training(base_model, tmp_path):
    from rhymerl.training.rl import train

    rows = _arith_rows(6)
    rows[4]["prompt"] = "4 + 5="
    data = _jsonl(tmp_path / "train.jsonl", rows)
    ov = rl_overrides(base_model, tmp_path / "run") + [f"data.train_files=[{data}]", "trainer.steps=1",
                                                       "trainer.eval_every=100"]
    with pytest.raises(DatasetError, match=r"train\.jsonl: row 4.*' '"):
        train(load_config(None, ov), progress=False)
    train(load_config(None, ov + ["data.skip_bad_rows=true"]), progress=False)
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]["step"] == 1


def test_a_batch_never_holds_one_prompt_twice():
    rows = _rows([f"{i}+{i}=" for i in range(10)])
    for seed in range(30):
        loader = PromptLoader(rows, 4, seed)
        served: list[str] = []
        for _ in range(25):
            batch = [r.key for r in loader.next_batch()]
            assert len(batch) == 4 and len(set(batch)) == 4, (seed, batch)
            served += batch
            if _ % 3 == 0:  # a checkpoint and resume in between changes nothing
                state = json.loads(json.dumps(loader.state_dict()))
                loader = PromptLoader(rows, 4, seed)
                loader.load_state_dict(state)
        # every epoch still serves every row once: 100 draws of 10 rows, each 10 times
        assert sorted(served.count(k) for k in {r.key for r in rows}) == [10] * 10


def test_heldout_samples_are_seeded_per_prompt():
    from rhymerl.llm import LLM
    from rhymerl.rewards import RewardRegistry
    from rhymerl.training.metrics.heldout import evaluate

    llm = LLM(tiny_model(), max_num_seqs=16, max_model_len=64)
    outs = []
    generate = llm.generate

    def recording(prompts, params, **kw):
        res = generate(prompts, params, **kw)
        outs.extend(res)
        return res

    llm.generate = recording
    rows = [PromptRow(str(k), [3, 4, 5], "d", "1") for k in range(3)]  # the same prompt under three keys
    evaluate(llm, rows, RewardRegistry(), max_tokens=12, temperature=1.0, n=4, seed=7)
    streams = [tuple(tuple(c.token_ids) for c in o.outputs) for o in outs]
    assert len(set(streams)) == 3  # one seed for every prompt would make these equal


# --- files -------------------------------------------------------------------------------------
def test_torn_jsonl_lines_and_config_on_resume(base_model, tmp_path, caplog):
    from rhymerl.training.rl import train

    ref = tmp_path / "ref"
    train(load_config(None, rl_overrides(base_model, ref) + ["trainer.steps=3"]), progress=False)
    run = tmp_path / "run"
    train(load_config(None, rl_overrides(base_model, run) + ["trainer.steps=2"]), progress=False)
    cfg_text = (run / "config.yaml").read_text()
    for name in ("metrics.jsonl", "traces.jsonl"):  # a kill tore the last line
        with open(run / name, "a") as f:
            f.write('{"step": 3, "critic/sco')
    (run / "config.yaml").write_text(cfg_text.replace("steps: 2", "steps: 3", 1))
    with caplog.at_level(logging.WARNING):
        train(resume=str(run), progress=False)
    assert "torn" in caplog.text
    assert learning_metrics(run) == learning_metrics(ref)
    assert [t["step"] for t in map(json.loads, (run / "traces.jsonl").read_text().splitlines())] == [1, 2, 3]
    (run / "config.yaml").write_text("")
    with pytest.raises(ConfigError, match=r"config\.yaml: empty"):
        train(resume=str(run), progress=False)
    (run / "config.yaml").unlink()
    with pytest.raises(ConfigError, match=r"config\.yaml: missing"):
        train(resume=str(run), progress=False)


def test_a_continued_run_keeps_its_settings(base_model, tmp_path):
    """A run folder runs on its own config.yaml: a changed learning key is refused naming it
    (implicitly or with --resume), nothing is trained; trainer.steps raised extends the run to a
    run configured with that many steps from the start, and config.yaml records it."""
    from rhymerl.training.rl import train

    ref = tmp_path / "ref"
    train(load_config(None, rl_overrides(base_model, ref) + ["trainer.steps=3"]), progress=False)
    run = tmp_path / "run"
    train(load_config(None, rl_overrides(base_model, run) + ["trainer.steps=2"]), progress=False)
    before, rows = (run / "config.yaml").read_text(), learning_metrics(run)
    changed = rl_overrides(base_model, run) + ["trainer.steps=3", "trainer.lr=0.5", "rollout.temperature=0.3"]
    with pytest.raises(ConfigError, match=r"other settings.*rollout\.temperature: 0\.7 -> 0\.3, "
                                          r"trainer\.lr: 0\.001 -> 0\.5\..*trainer\.output_dir.*--resume"):
        train(load_config(None, changed), progress=False)
    with pytest.raises(ConfigError, match=r"trainer\.lr: 0\.001 -> 0\.5"):
        train(resume=str(run), resume_overrides=["trainer.lr=0.5"], progress=False)
    with pytest.raises(ConfigError, match=r"trainer\.steps: 2 -> 1 is below the step"):
        train(resume=str(run), resume_overrides=["trainer.steps=1"], progress=False)
    assert (run / "config.yaml").read_text() == before and learning_metrics(run) == rows
    # placement keys may change (used for that session alone); trainer.steps extends the run
    train(load_config(None, rl_overrides(base_model, run) + ["trainer.steps=3", "reward.workers=2"]),
          progress=False)
    assert load_config(run / "config.yaml").trainer.steps == 3
    assert load_config(run / "config.yaml").reward.workers == load_config(None, rl_overrides(base_model, run)).reward.workers
    assert learning_metrics(run) == learning_metrics(ref)


def test_a_cosine_run_is_not_extended(base_model, tmp_path):
    from rhymerl.training.rl import train

    run = tmp_path / "run"
    cosine = rl_overrides(base_model, run) + ["trainer.lr_schedule=cosine"]
    train(load_config(None, cosine + ["trainer.steps=1"]), progress=False)
    with pytest.raises(ConfigError, match=r"trainer\.steps: 1 -> 2 cannot extend .*cosine"):
        train(resume=str(run), resume_overrides=["trainer.steps=2"], progress=False)


def test_each_engine_has_its_own_default_run_folder():
    from rhymerl.training.rl import run_dir_for

    native, vllm = run_dir_for(load_config()), run_dir_for(load_config(None, ["rollout.engine=vllm"]))
    assert native != vllm and native.name.endswith("-native") and vllm.name.endswith("-vllm")


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(base_model, tmp_path, caplog):
    from rhymerl.training.rl import train

    ref = tmp_path / "ref"
    train(load_config(None, rl_overrides(base_model, ref) + ["trainer.steps=3"]), progress=False)
    run = tmp_path / "run"
    train(load_config(None, rl_overrides(base_model, run) + ["trainer.steps=2"]), progress=False)
    newest = latest_checkpoint(run)
    (newest / "optim.pt").write_bytes(b"\x00garbage")
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("steps: 2", "steps: 3", 1))
    with caplog.at_level(logging.WARNING):
        train(resume=str(run), progress=False)
    assert "optim.pt" in caplog.text and "older checkpoint" in caplog.text
    assert learning_metrics(run) == learning_metrics(ref)


# --- state -------------------------------------------------------------------------------------
def test_history_with_valid_checksum_but_malformed_body_is_discarded(tmp_path, caplog):
    import gzip
    import hashlib

    from rhymerl.drafting import HistoryStore

    for body in [{"version": 1, "tokenizer": None, "max_rollouts": 1, "prompt_tail": 5},  # no prompts
                 {"version": 1, "tokenizer": None, "max_rollouts": 1, "prompt_tail": 5,
                  "prompts": {"a": {"tail": [1], "rollouts": [{"step": 1, "responses": [[1, "x"]], "rewards": [0]}]}}},
                 {"version": 1, "tokenizer": None, "max_rollouts": "1", "prompt_tail": 5, "prompts": {}},
                 {"version": 1, "tokenizer": None, "max_rollouts": 1, "prompt_tail": 5,
                  "prompts": {"a": {"tail": [1], "rollouts": [{"step": 1, "responses": [[1]], "rewards": []}]}}}]:
        text = json.dumps(body)
        doc = json.dumps({"sha256": hashlib.sha256(text.encode()).hexdigest(), "body": text})
        path = tmp_path / "h.json.gz"
        path.write_bytes(gzip.compress(doc.encode()))
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            store = HistoryStore.load(path)
        assert len(store) == 0 and "discarded" in caplog.text


def test_drafts_come_from_the_previous_epoch_through_the_worker_path():
    """A worker's store gets each prompt's history by ``put`` every step; the drafter's cached
    index must follow it (it used to keep the first epoch's: the revision restarted at 1)."""
    from rhymerl.drafting import HistoryStore, build_proposer

    store = HistoryStore(max_rollouts=1)
    drafter = build_proposer({"method": "history"}, store)
    source = drafter.sources[0]  # prompt_history
    prompt = [5, 6, 7, 8, 9]
    for epoch in range(1, 6):  # epoch e's responses are [10+e, 20+e, 30+e, EOS]
        drafter.begin(epoch)
        store.put("p", prompt, [(epoch - 1, [[10 + epoch - 1, 20 + epoch - 1, 30 + epoch - 1, 2]] * 2, [None] * 2)]
                  if epoch > 1 else [])
        idx = source.index("p")
        if epoch == 1:
            assert idx is None
            continue
        indexed = {tuple(idx.tokens(sid)[len(prompt):]) for sid in range(len(idx))}
        assert indexed == {(10 + epoch - 1, 20 + epoch - 1, 30 + epoch - 1, 2)}, (epoch, indexed)


def test_long_generation_keeps_engine_stats_and_drafter_cache_flat():
    from rhymerl.drafting import HistoryStore, build_proposer
    from rhymerl.engine import SamplingParams
    from rhymerl.llm import LLM

    store = HistoryStore(max_rollouts=1, max_total_tokens=400)  # evicts: at most a few prompts fit
    drafter = build_proposer({"method": "history"}, store)
    llm = LLM(tiny_model(), max_num_seqs=16, max_model_len=64, speculative=drafter)
    sizes = []
    for rnd in range(12):
        keys = [f"r{rnd}-{i}" for i in range(6)]  # new prompts every round: old ones are evicted
        llm.generate([[3, 4, 5 + i] for i in range(6)], SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=rnd),
                     prompt_keys=keys, use_tqdm=False)
        for k in keys:  # history of what was generated, as the RL loop records it
            store.add(k, [3, 4, 5], [[7, 8, 9, 10]] * 30, rnd)
        sizes.append((len(vars(llm.engine.stats)), len(drafter.sources[0]._indices), len(store)))
    assert all(isinstance(v, (int, float)) for v in vars(llm.engine.stats).values())  # counters, no lists
    assert max(s[1] for s in sizes[3:]) <= max(s[2] for s in sizes) + 1
    assert sizes[-1][1] <= sizes[4][1] + 1 and sizes[-1][0] == sizes[0][0]


def test_trainer_logprobs_follow_top_p_and_top_k():
    from rhymerl.engine import SamplingParams
    from rhymerl.llm import LLM
    from rhymerl.training.update.trainer import Experience, PolicyTrainer

    cfg = load_config(None, ["rollout.temperature=1.0", "rollout.top_p=0.9", "rollout.top_k=8",
                             "trainer.ppo_mini_batches=2"])
    model = tiny_model(std=0.1)  # flatter distributions: top-p and top-k both cut
    out = LLM(model, max_num_seqs=8, max_model_len=64).generate(
        [[3, 4, 5]], SamplingParams(n=4, temperature=1.0, top_p=0.9, top_k=8, max_tokens=12, seed=3, logprobs=True,
                                    ignore_eos=True), use_tqdm=False)[0]
    tr = PolicyTrainer(model, cfg.trainer, cfg.algorithm, torch.device("cpu"), temperature=1.0, top_p=0.9, top_k=8)
    exp = Experience.build([[3, 4, 5]] * 4, [c.token_ids for c in out.outputs], [0.0] * 4, pad_id=0)
    tr.compute_logps(exp)
    plain = PolicyTrainer(model, cfg.trainer, cfg.algorithm, torch.device("cpu"), temperature=1.0)
    exp2 = Experience.build([[3, 4, 5]] * 4, [c.token_ids for c in out.outputs], [0.0] * 4, pad_id=0)
    plain.compute_logps(exp2)
    for i, c in enumerate(out.outputs):
        got = exp.old_logp[i][exp.response_mask[i].bool()]
        assert torch.allclose(got, torch.tensor(c.logprobs), atol=1e-5)
    # without the mask the log-probs differ: the test can fail
    assert not torch.allclose(exp2.old_logp * exp2.response_mask, exp.old_logp * exp.response_mask, atol=1e-3)


# --- Ray ---------------------------------------------------------------------------------------
_PROBE = """
import sys, ray
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).internal_kv_keys(b"", namespace=None, timeout=10)
except ray.exceptions.AuthenticationError as e:
    print("REFUSED", e)
    sys.exit(3)
print("ACCEPTED")
"""


@pytest.mark.slow
def test_ray_backend_keeps_token_authentication_on():
    ray = pytest.importorskip("ray")
    from rhymerl.distribution.backends import init_ray

    before = os.environ.get("RAY_AUTH_MODE")
    ray.shutdown()
    init_ray(num_cpus=1)
    try:
        assert before != "disabled" and os.environ.get("RAY_AUTH_MODE") != "disabled"
        addr = ray.get_runtime_context().gcs_address
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        probes = {"no token": {"HOME": tempfile.mkdtemp(), "RAY_AUTH_MODE": "disabled"},
                  "wrong token": {"HOME": tempfile.mkdtemp(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "x" * 32},
                  "the cluster's token": {"RAY_AUTH_MODE": "token"}}
        got = {}
        for name, extra in probes.items():
            r = subprocess.run([sys.executable, "-c", _PROBE, addr], env={**env, **extra}, capture_output=True,
                               text=True, timeout=120)
            got[name] = "ACCEPTED" if r.returncode == 0 else ("REFUSED" if r.returncode == 3 else r.stderr[-400:])
        assert got == {"no token": "REFUSED", "wrong token": "REFUSED", "the cluster's token": "ACCEPTED"}
    finally:
        ray.shutdown()


def test_a_run_killed_before_its_first_checkpoint_starts_over_cleanly(base_model, tmp_path):
    """Found by scripts/fault_inject.py: a kill in step 1 left the initial evaluation's row (and
    step 1's trace) behind, and the restarted run logged them again."""
    import shutil

    from rhymerl.training.rl import train

    ov = ["trainer.steps=2"]
    train(load_config(None, rl_overrides(base_model, tmp_path / "ref") + ov), progress=False)
    run = tmp_path / "run"
    train(load_config(None, rl_overrides(base_model, run) + ov), progress=False)
    shutil.rmtree(run / "checkpoints")  # as if killed after logging, before any checkpoint
    train(resume=str(run), progress=False)
    assert learning_metrics(run) == learning_metrics(tmp_path / "ref")
    assert [json.loads(t)["step"] for t in (run / "traces.jsonl").read_text().splitlines()] == [1, 2]
