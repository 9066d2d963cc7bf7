"""Every blocking call to another process is bounded by the config: a hung or dead peer stops
the run with an error naming it (and --resume), never a wait forever."""
from __future__ import annotations

import os
import signal
import time

import pytest

from rhymerl.config import load_config
from rhymerl.distribution.work import WorkerLost


def _spec(model_dir: str):
    from rhymerl.distribution.work import WorkerSpec

    return WorkerSpec(model_dir, max_num_seqs=4, max_model_len=32, threads=1)


def test_a_stopped_worker_does_not_hold_a_weight_sync_forever(model_dir):
    from rhymerl.distribution.backends import ProcessPool
    from rhymerl.model import load_pretrained

    named = dict(load_pretrained(model_dir).named_parameters())
    # Built with room (two fresh processes load torch in a few seconds on a busy machine); the
    # bound under test is the one on the calls after.
    pool = ProcessPool([_spec(model_dir), _spec(model_dir)], named, timeout_s=60.0)
    pool.timeout_s = 3.0
    try:
        pool.update_weights(named)  # answers
        os.kill(pool.handles[1].proc.pid, signal.SIGSTOP)
        t = time.monotonic()
        with pytest.raises(WorkerLost, match=r"worker 1 lost: no answer to 'load_shared' in 3s.*--resume"):
            pool.update_weights(named)
        assert time.monotonic() - t < 10
        with pytest.raises(WorkerLost, match="worker 0"):  # the same bound on the gate-state calls
            os.kill(pool.handles[0].proc.pid, signal.SIGSTOP)
            pool.gate_states()
    finally:
        for h in pool.handles:
            if h.proc.is_alive():
                os.kill(h.proc.pid, signal.SIGCONT)
        pool.close()


def test_a_worker_that_is_never_built_is_named():
    from rhymerl.distribution import backends

    t = time.monotonic()
    with pytest.raises(WorkerLost, match="not built within 2s"):
        backends.spawn_processes(_SlowBuild, [(), ()], name="rhymerl-test", timeout=2.0)
    assert time.monotonic() - t < 10


class _SlowBuild:
    def __init__(self) -> None:
        time.sleep(60)


def test_trainer_ranks_asking_for_a_gpu_the_cluster_lacks_stop_the_run(base_model, tmp_path):
    pytest.importorskip("ray")
    import ray

    from rhymerl.model import load_pretrained
    from rhymerl.training.update.trainer_group import TrainerGroup

    cfg = load_config(None, ["trainer.world_size=2", "rollout.backend=ray", "model.device=cuda",
                             "trainer.rank_timeout_s=5"])
    t = time.monotonic()
    try:
        with pytest.raises(WorkerLost, match=r"trainer ranks \[0, 1\] not started within 5s.*GPUs"):
            TrainerGroup(cfg, base_model, load_pretrained(base_model), with_ref=False, total_optimizer_steps=1)
    finally:
        ray.shutdown()
    assert time.monotonic() - t < 60


# --- the cluster's doors ------------------------------------------------------------------------
def test_ray_without_token_authentication_is_refused_unless_allowed():
    import subprocess
    import sys

    code = ("from rhymerl.distribution.backends import init_ray\n"
            "import sys\n"
            "try:\n    init_ray(num_cpus=1, allow_insecure=sys.argv[1] == '1')\n"
            "except Exception as e:\n    print(type(e).__name__, e); sys.exit(3)\n"
            "import ray; ray.shutdown(); print('STARTED')\n")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    refused = subprocess.run([sys.executable, "-c", code, "0"], env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 3 and "InsecureClusterError" in refused.stdout
    assert "cluster.allow_insecure=true" in refused.stdout
    allowed = subprocess.run([sys.executable, "-c", code, "1"], env=env, capture_output=True, text=True, timeout=180)
    assert "STARTED" in allowed.stdout and "running anyway" in allowed.stderr
    # Ray started by the user's program before the run, without authentication: refused all the same
    before = ("import ray, sys\nray.init(num_cpus=1, include_dashboard=False)\n" + code)
    started = subprocess.run([sys.executable, "-c", before, "0"], env=env, capture_output=True, text=True, timeout=180)
    assert started.returncode == 3 and "InsecureClusterError" in started.stdout, started.stdout + started.stderr[-500:]


def test_any_ray_authentication_mode_but_disabled_is_accepted(monkeypatch):
    ray_raylet = pytest.importorskip("ray._raylet")
    from rhymerl.distribution.backends import ray_authenticated

    class Mode:  # Ray's enum, with the Kubernetes token mode newer versions add
        DISABLED, TOKEN, K8S = "disabled", "token", "k8s"

    for mode, ok in ((Mode.TOKEN, True), (Mode.K8S, True), (Mode.DISABLED, False)):
        monkeypatch.setattr(ray_raylet, "AuthenticationMode", Mode)
        monkeypatch.setattr(ray_raylet, "get_authentication_mode", lambda m=mode: m)
        assert ray_authenticated() is ok


def test_rank_zeros_rendezvous_store_listens_on_the_node_address_alone(base_model, monkeypatch):
    # It listened on every interface, on a port picked by bind-then-close (free for anyone in between).
    pytest.importorskip("ray")
    import subprocess

    import ray
    import torch.distributed as dist

    from rhymerl.training.update.rank import RankSpec, TrainerRank

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    cfg = load_config(None, [])
    rank = TrainerRank(RankSpec(base_model, cfg.trainer, cfg.algorithm, rank=0, world_size=1))
    address = rank.node_address()
    port = int(address.rsplit(":", 1)[1])
    assert address.startswith("tcp://127.0.0.1:") and rank._listen.getsockname() == ("127.0.0.1", port)
    try:
        rank.setup(address, False)
        listening = [line.split()[3] for line in subprocess.run(["ss", "-ltn"], capture_output=True,
                                                                 text=True).stdout.splitlines()[1:]]
        assert f"127.0.0.1:{port}" in listening
        assert f"*:{port}" not in listening and f"0.0.0.0:{port}" not in listening
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_background_rollout_that_never_ends_stops_the_run_naming_it():
    from rhymerl.training.rollout.policy_versions import PolicyVersions

    versions = PolicyVersions(1, dict, lambda named: None, wait_s=1.0)
    versions.launch(2, lambda: time.sleep(30))
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rollout of step 2 did not finish within 1s.*--resume"):
        versions.take(2)
    assert time.monotonic() - t < 5
