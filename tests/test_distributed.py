"""Trainer ranks (trainer.world_size > 1): the same update as one process, sharded state,
kill-and-resume, resharding, Ray, and a rank that dies or hangs."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from rhymerl.config import ConfigError, load_config
from rhymerl.training.checkpoint import latest_checkpoint
from rhymerl.training.update.token_balance import balance_by_tokens

from tests.helpers import kill_and_resume, learning_metrics, rl_overrides

# A nonzero gradient on the tiny task (its base model scores 0, so advantages are 0 alone).
LEARN = ["algorithm.entropy_coef=0.05"]


def test_balance_by_tokens_evens_the_ranks_and_keeps_every_row():
    lengths = [90, 10, 40, 40, 30, 5, 60, 20]
    parts = balance_by_tokens(lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= 10
    assert balance_by_tokens(lengths, 2) == parts  # a function of the lengths alone
    assert balance_by_tokens([7], 3) == [[0], [], []]


def close(a: dict, b: dict, tol: float = 1e-4) -> bool:
    """Two learning-metric rows equal up to float tolerance (another world size sums in another order)."""
    if a.keys() != b.keys():
        return False
    return all(abs(a[k] - b[k]) <= tol * max(1.0, abs(b[k])) if isinstance(b[k], float) else a[k] == b[k]
               for k in b)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_ranks_give_one_process_gradient_and_fsdp_halves_the_state(tmp_path, strategy):
    from rhymerl.bench.train import bench_model, measure, reference_gradient, synthetic_batch

    model_path = bench_model(tmp_path / "policy", vocab=64)
    exp = synthetic_batch(64, sequences=12)
    overrides = ["trainer.micro_batch_tokens=256"]  # several micro-batches, unequal per rank
    ref = reference_gradient(model_path, exp, overrides)
    row = measure(model_path, exp, 2, strategy, overrides, ref, repeats=1)
    assert row["grad_rel_diff_vs_1"] <= 1e-6
    # parameters, gradients, two Adam moments, and Adam's step count per parameter
    full = sum(t.numel() * 4 for t in ref.values()) * 4 + 4 * len(ref)
    if strategy == "fsdp":
        assert row["param_state_bytes_per_rank"] <= 0.55 * full
    else:
        assert row["param_state_bytes_per_rank"] == full
    assert row["sync_bytes"] == sum(t.numel() * 4 for t in ref.values())


@pytest.mark.slow
def test_two_rank_run_is_one_process_run_and_resumes_exactly_and_reshards(base_model, tmp_path):
    """FSDP on 2 ranks learns what one process learns (float tolerance); kill -9 mid-run and
    --resume reproduces the straight 2-rank run exactly; a 2-rank checkpoint continues on 1
    process and a 1-process checkpoint on 2 ranks."""
    from rhymerl.training.rl import train

    four = ["trainer.steps=4", *LEARN]
    two = ["trainer.world_size=2", "trainer.strategy=fsdp"]
    train(load_config(None, rl_overrides(base_model, tmp_path / "one") + four), progress=False)
    train(load_config(None, rl_overrides(base_model, tmp_path / "ref") + four + two), progress=False)
    one, ref = learning_metrics(tmp_path / "one"), learning_metrics(tmp_path / "ref")
    assert len(ref) == 5 and all(close(a, b) for a, b in zip(ref, one))
    assert any(r.get("actor/grad_norm", 0) > 0 for r in ref)
    assert (latest_checkpoint(tmp_path / "ref") / "trainer" / ".metadata").exists()

    run = tmp_path / "killed"  # kill -9 of the controller and its ranks after step 2, then --resume
    kill_and_resume(run, rl_overrides(base_model, run) + four + two, after_step=2, last_step=4)
    assert learning_metrics(run) == ref

    # Reshard: the first two steps on 2 ranks, the rest on 1 process from the sharded checkpoint.
    part = tmp_path / "resharded"
    train(load_config(None, rl_overrides(base_model, part) + four + two + ["trainer.steps=2"]), progress=False)
    with pytest.raises(ConfigError, match=r"other settings \(--resume\): trainer\.lr"):
        train(resume=str(part), resume_overrides=["trainer.lr=1.0"], progress=False)
    train(resume=str(part), resume_overrides=["trainer.world_size=1"], progress=False)
    # the run's config says 2 steps; --resume keeps it, so continue the folder with 4 on 1 process
    train(load_config(None, rl_overrides(base_model, part) + four), progress=False)
    resharded = learning_metrics(part)
    assert len(resharded) == 5 and all(close(a, b) for a, b in zip(resharded, ref))
    # ... and a 1-process checkpoint continues on 2 ranks (its optimizer state scattered to them)
    grown = tmp_path / "grown"
    train(load_config(None, rl_overrides(base_model, grown) + four + ["trainer.steps=2"]), progress=False)
    train(load_config(None, rl_overrides(base_model, grown) + four + two), progress=False)
    grown_rows = learning_metrics(grown)
    assert len(grown_rows) == 5 and all(close(a, b) for a, b in zip(grown_rows, one))

    # A damaged sharded checkpoint is named and the one before used (it crashed every rank before).
    import shutil

    from rhymerl.training.rl import RLRun, load_run_config

    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "ref", damaged)
    shard = next((latest_checkpoint(damaged) / "trainer").glob("*.distcp"))
    b = bytearray(shard.read_bytes())
    b[len(b) // 2] ^= 1
    shard.write_bytes(bytes(b))
    rl = RLRun(load_run_config(damaged), damaged, progress=False)
    try:
        rl.resume()
        assert rl.step == 3
    finally:
        rl.close()

    from rhymerl.model import load_pretrained
    from rhymerl.training.checkpoint import export_policy

    exported = export_policy(tmp_path / "ref", tmp_path / "export")
    assert sorted(p.name for p in exported.glob("*.safetensors")) == ["model.safetensors"]
    load_pretrained(exported)


@pytest.mark.slow
def test_two_ranks_on_ray(base_model, tmp_path):
    """DDP on 2 Ray actors learns what one process learns."""
    from rhymerl.training.rl import train

    two = ["trainer.steps=2", *LEARN]
    train(load_config(None, rl_overrides(base_model, tmp_path / "one") + two), progress=False)
    train(load_config(None, rl_overrides(base_model, tmp_path / "ray") + two +
                      ["trainer.world_size=2", "trainer.strategy=ddp", "rollout.backend=ray"]), progress=False)
    one, ray_ = learning_metrics(tmp_path / "one"), learning_metrics(tmp_path / "ray")
    assert len(ray_) == 3 and all(close(a, b) for a, b in zip(ray_, one))
    rows = [r for r in ray_ if "actor/grad_norm" in r]
    assert rows and all(r["actor/grad_norm"] > 0 for r in rows)


def _group(tmp_path: Path, timeout_s: float):
    from rhymerl.bench.train import bench_model, synthetic_batch
    from rhymerl.training.update.trainer_group import TrainerGroup
    from rhymerl.model import load_pretrained

    path = bench_model(tmp_path / "policy", vocab=64)
    cfg = load_config(None, ["trainer.world_size=2", f"trainer.collective_timeout_s={timeout_s}",
                             f"trainer.rank_timeout_s={3 * timeout_s}", "trainer.ppo_mini_batches=1"])
    return TrainerGroup(cfg, path, load_pretrained(path), with_ref=False, total_optimizer_steps=2), \
        synthetic_batch(64, sequences=6)


@pytest.mark.parametrize("fault", ["dies", "hangs"])
def test_a_rank_that_dies_or_hangs_stops_the_run_in_bounded_time(tmp_path, fault):
    from rhymerl.training.update.trainer_group import TrainerRankError

    group, exp = _group(tmp_path, timeout_s=4.0)
    try:
        pid = group.handles[1].proc.pid
        os.kill(pid, signal.SIGKILL if fault == "dies" else signal.SIGSTOP)
        t = time.monotonic()
        with pytest.raises(TrainerRankError, match="--resume") as err:
            group.update(exp, step=1, seed=0)
        assert time.monotonic() - t < 20
        assert "rank" in str(err.value)
        with pytest.raises(TrainerRankError, match="stopped"):
            group.update(exp, step=2, seed=0)  # never a half-alive group
    finally:
        if fault == "hangs":
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        group.close()
