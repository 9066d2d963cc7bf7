"""Exact resume, piece by piece: a run resumed from its step-2 checkpoint learns exactly what the
uninterrupted run learns, and skipping the restore of any one piece of state changes that (so
the exactness tests can fail). Also: what a resume trusts (the manifest, no code from the folder)."""
from __future__ import annotations

import copy
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from rhymerl.atomic_io import read_jsonl
from rhymerl.config import load_config
from tests.helpers import learning_metrics, rl_overrides

# Cosine with warm-up, so the scheduler's position matters; checkpoints at steps 2 and 4.
RESUME = ["trainer.steps=4", "trainer.save_every=2", "trainer.eval_every=0", "trainer.lr_schedule=cosine",
          "trainer.warmup_steps=1"]


def _what_it_learnt(run: Path) -> tuple[list[dict], list[dict]]:
    """Learning metrics, and the traces without the gate's timing-driven counts."""
    traces = [{k: v for k, v in t.items() if k not in ("forwards", "gen_s")} for t in read_jsonl(run / "traces.jsonl")]
    return learning_metrics(run), traces


@pytest.fixture(scope="module")
def reference(base_model, tmp_path_factory) -> Path:
    from rhymerl.training.rl import train

    run = tmp_path_factory.mktemp("resume") / "ref"
    train(load_config(None, rl_overrides(base_model, run) + RESUME), progress=False)
    return run


def _resume_from_step_2(reference: Path, run: Path) -> Path:
    from rhymerl.training.rl import train

    shutil.copytree(reference, run)
    shutil.rmtree(run / "checkpoints" / "step_000004")
    train(resume=str(run), progress=False)
    return run


def test_a_run_resumed_from_its_checkpoint_learns_exactly_what_the_uninterrupted_run_learns(reference, tmp_path):
    ref = _what_it_learnt(reference)
    assert all(r["actor/grad_norm"] > 1e-3 for r in ref[0][1:])  # it learns at every step
    assert _what_it_learnt(_resume_from_step_2(reference, tmp_path / "run")) == ref


def _skip_weights(mp):
    import rhymerl.training.rl as rl

    orig = rl.load_checkpoint_into

    def load(ckpt, model, *a, **k):
        before = copy.deepcopy(model.state_dict())
        st = orig(ckpt, model, *a, **k)
        model.load_state_dict(before)
        return st

    mp.setattr(rl, "load_checkpoint_into", load)


def _skip_trainer_part(attr: str):
    def skip(mp):
        from rhymerl.training.update.trainer import PolicyTrainer

        orig = PolicyTrainer._load_single

        def load(self, path):
            before = copy.deepcopy(getattr(self, attr).state_dict())
            orig(self, path)
            getattr(self, attr).load_state_dict(before)

        mp.setattr(PolicyTrainer, "_load_single", load)
    return skip


def _skip_loader(mp):
    from rhymerl.data.loader import PromptLoader

    mp.setattr(PromptLoader, "load_state_dict", lambda self, state: None)


def _skip_history(mp):
    from rhymerl.drafting import HistoryStore

    mp.setattr(HistoryStore, "replace_with", lambda self, other: None)


SKIPS = {"weights": _skip_weights, "optimizer": _skip_trainer_part("optimizer"),
         "scheduler": _skip_trainer_part("scheduler"), "loader": _skip_loader, "history": _skip_history}


@pytest.mark.parametrize("piece", sorted(SKIPS))
def test_skipping_the_restore_of_any_piece_changes_what_the_run_learns(reference, tmp_path, monkeypatch, piece):
    SKIPS[piece](monkeypatch)
    assert _what_it_learnt(_resume_from_step_2(reference, tmp_path / "run")) != _what_it_learnt(reference)


def test_the_global_rngs_are_those_of_the_checkpoint(reference):
    # nothing in the loop draws from the global RNGs today (every draw is seeded by step and
    # prompt), so the check is on the state itself: a resume that skipped it fails here
    import numpy as np
    import random

    from rhymerl.training.checkpoint import latest_checkpoint
    from rhymerl.training.rl import RLRun, load_run_config

    torch.manual_seed(12345)
    np.random.seed(12345)
    random.seed(12345)
    run = RLRun(load_run_config(reference), reference, progress=False)
    try:
        run.resume()
        saved = torch.load(latest_checkpoint(reference) / "rng.pt", weights_only=True)
        assert torch.equal(torch.get_rng_state(), saved["torch"])
        assert np.array_equal(np.random.get_state()[1], saved["numpy"].numpy().astype(np.uint32))
        assert list(random.getstate()[1]) == saved["python"].tolist()
    finally:
        run.close()


# --- what a resume trusts ----------------------------------------------------------------------
class _Payload:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


def test_resume_runs_no_code_from_the_run_folder(reference, tmp_path):
    # A pickle placed where the sharded reader would look, in a one-process run's newest
    # checkpoint: the resume neither unpickles it nor trusts the folder (an added file), and
    # continues from the checkpoint before.
    from rhymerl.training.checkpoint import latest_checkpoint
    from rhymerl.training.rl import RLRun, load_run_config

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    marker = tmp_path / "pwned"
    newest = latest_checkpoint(run)
    (newest / "trainer").mkdir()
    (newest / "trainer" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    rl = RLRun(load_run_config(run), run, progress=False)
    try:
        rl.resume()
        assert rl.step == 2  # the newest was refused, the one before used
    finally:
        rl.close()
    assert not marker.exists()
    # and a one-process trainer never calls the sharded reader, manifest or not
    from rhymerl.training.update.trainer import PolicyTrainer

    calls = []
    orig = PolicyTrainer._load_sharded
    try:
        PolicyTrainer._load_sharded = lambda self, folder: calls.append(folder)
        cfg = load_run_config(run)
        rl = RLRun(cfg, run, progress=False)
        rl.trainer.load_state(newest, 1)
        rl.close()
    finally:
        PolicyTrainer._load_sharded = orig
    assert not calls and not marker.exists()


@pytest.mark.parametrize("how", ["flip", "add", "delete"])
def test_a_changed_added_or_missing_file_is_named_and_the_checkpoint_before_used(reference, tmp_path, how):
    from rhymerl.training.checkpoint import CheckpointError, latest_checkpoint, verify_manifest

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    newest = latest_checkpoint(run)
    target = newest / "policy" / "model.safetensors"
    if how == "flip":  # a flipped byte in the weights used to load silently
        b = bytearray(target.read_bytes())
        b[len(b) // 2] ^= 1
        target.write_bytes(bytes(b))
    elif how == "add":
        target = newest / "policy" / "extra.py"
        target.write_text("print('hi')\n")
    else:
        target.unlink()
    with pytest.raises(CheckpointError, match=str(target.relative_to(newest))):
        verify_manifest(newest)
    manifest = json.loads((newest / "manifest.json").read_text())
    assert "policy/model.safetensors" in manifest and "state.json" in manifest


def test_a_damaged_sharded_trainer_state_is_a_checkpoint_error_not_a_crash(tmp_path):
    # torch.distributed.checkpoint raises CheckpointException, a BaseException that escaped
    # `except Exception`: one process crashed, N ranks failed every --resume.
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from rhymerl.training.checkpoint import CheckpointError
    from rhymerl.training.update.trainer import TRAINER_DIR, PolicyTrainer
    from tests.helpers import tiny_model

    cfg = load_config(None, [])
    trainer = PolicyTrainer(tiny_model(), cfg.trainer, cfg.algorithm, torch.device("cpu"))
    msd, osd = get_state_dict(trainer.model, trainer.optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / TRAINER_DIR, no_dist=True)
    torch.save({"scheduler": trainer.scheduler.state_dict()}, tmp_path / TRAINER_DIR / "scheduler.pt")
    trainer.load_state(tmp_path, 2)  # intact: loads
    shard = next((tmp_path / TRAINER_DIR).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=TRAINER_DIR):
        trainer.load_state(tmp_path, 2)


def test_export_refuses_an_existing_folder_unless_forced_and_checks_the_manifest(reference, tmp_path):
    from rhymerl.training.checkpoint import CheckpointError, export_policy, latest_checkpoint

    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="already exists"):
        export_policy(reference, out)
    assert (out / "mine.txt").read_text() == "keep me"  # nothing of it was deleted
    export_policy(reference, out, force=True)
    assert (out / "model.safetensors").exists() and not (out / "mine.txt").exists()
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    (latest_checkpoint(run) / "policy" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="config.json"):
        export_policy(run, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_a_failed_resume_leaves_no_process_behind(reference, tmp_path):
    import multiprocessing

    from rhymerl.training.checkpoint import CheckpointError, complete_checkpoints
    from rhymerl.training.rl import train

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    for ck in complete_checkpoints(run):
        (ck / "state.json").write_text("{}")
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(CheckpointError, match="no checkpoint could be restored"):
        train(resume=str(run), progress=False)
    assert {p.pid for p in multiprocessing.active_children() if p.is_alive()} <= before


def test_logs_are_on_disk_when_a_checkpoint_is_committed(base_model, tmp_path, monkeypatch):
    import rhymerl.training.rl as rl

    synced = []
    monkeypatch.setattr(rl, "fsync_file", lambda p: synced.append(Path(p).name))
    rl.train(load_config(None, rl_overrides(base_model, tmp_path / "run") + ["trainer.steps=1", "trainer.eval_every=0"]),
             progress=False)
    assert synced == ["metrics.jsonl", "traces.jsonl"]


def test_rendezvous_folders_of_dead_processes_are_removed(tmp_path, monkeypatch):
    import os
    import tempfile

    from rhymerl.training.update import trainer_group

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = tmp_path / f"{trainer_group.RDZV_PREFIX}999999999-abc"  # no such pid
    alive = tmp_path / f"{trainer_group.RDZV_PREFIX}{os.getpid()}-abc"
    dead.mkdir()
    alive.mkdir()
    new = Path(trainer_group.rendezvous_dir())
    assert not dead.exists() and alive.exists() and new.exists() and new.name.startswith(
        f"{trainer_group.RDZV_PREFIX}{os.getpid()}-")


def test_a_weight_index_naming_a_file_outside_the_model_folder_is_refused(tmp_path):
    from rhymerl.model import load_pretrained, save_pretrained
    from tests.helpers import tiny_model

    save_pretrained(tiny_model(), tmp_path / "m")
    (tmp_path / "secret.safetensors").write_bytes((tmp_path / "m" / "model.safetensors").read_bytes())
    (tmp_path / "m" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "../secret.safetensors"}}))
    with pytest.raises(ValueError, match="not a file of this folder"):
        load_pretrained(tmp_path / "m")


def test_inputs_outside_the_run_folder_are_pinned_by_absolute_path_and_sha256(base_model, tmp_path, monkeypatch,
                                                                              caplog):
    import logging

    from rhymerl.config import ConfigError
    from rhymerl.training.rl import train

    work = tmp_path / "work"
    work.mkdir()
    (work / "reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                                    "    return 0.5 if solution_str else 0.0\n")
    monkeypatch.chdir(work)
    run = tmp_path / "run"
    train(load_config(None, rl_overrides(base_model, run) + ["trainer.steps=1", "trainer.eval_every=0",
                                                             "data.reward_file=reward.py"]), progress=False)
    assert str(work / "reward.py") in (run / "config.yaml").read_text()  # absolute
    assert str(work / "reward.py") in json.loads((run / "inputs.json").read_text())
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("steps: 1", "steps: 2", 1))
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.chdir(other)  # another working directory: the same files
    (work / "reward.py").write_text((work / "reward.py").read_text().replace("0.5", "1.0"))
    with pytest.raises(ConfigError, match=r"reward\.py: changed since the run started"):
        train(resume=str(run), progress=False)
    with caplog.at_level(logging.WARNING):
        train(resume=str(run), progress=False, accept_changed_inputs=True)
    assert "--accept-changed-inputs" in caplog.text
    assert json.loads((run / "summary.json").read_text())["steps"] == 2


def test_histopipes_placement_scores_come_back_with_the_checkpoint(reference, tmp_path, monkeypatch):
    """HistoPipe's ``auto`` placement continues where it was (speed only: tokens never depend on it)."""
    import json

    from rhymerl.distribution.coordinator import RolloutCoordinator as Coordinator

    saved = json.loads((reference / "checkpoints" / "step_000002" / "state.json").read_text())["placement"]
    assert set(saved) == {"scores", "steps", "share_error_sq", "length_error_sigma"}
    got = []
    orig = Coordinator.load_placement_state

    def load(self, state):
        orig(self, state)
        got.append(self.placement_state())

    monkeypatch.setattr(Coordinator, "load_placement_state", load)
    _resume_from_step_2(reference, tmp_path / "run")
    assert got == [saved]


def test_a_malformed_placement_state_is_a_checkpoint_error(tmp_path):
    from rhymerl.training.checkpoint import CheckpointError
    from rhymerl.training.run.state import read_run_state

    with pytest.raises(CheckpointError, match="placement"):
        read_run_state(tmp_path, {"step": 2, "loader": {}, "placement": {"scores": [1, 2]}}, {})
