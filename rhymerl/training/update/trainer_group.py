"""The policy's trainer ranks, seen from the controller: start them, call them all at once,
collect their parts, and stop the run with a clear error if one dies or hangs.

Ranks are local processes started from the fork server (rendezvous through a file in a
private folder; gloo on the loopback interface only) or Ray actors (rendezvous at rank 0's node
address). Each rank is a :class:`rhymerl.training.update.rank.TrainerRank`.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from rhymerl.config import RunConfig
from rhymerl.distribution.backends import WorkerHandle, init_ray, shared_buffer, spawn_processes
from rhymerl.distribution.work import WorkerLost
from rhymerl.model import CausalLM
from rhymerl.training.update.rank import RankSpec, TrainerRank
from rhymerl.training.update.trainer import Experience, SyncStats

log = logging.getLogger(__name__)


RDZV_PREFIX = "rhymerl-rdzv-"


def rendezvous_dir() -> str:
    """A private folder for the ranks' file rendezvous, named for this process; folders left
    by processes that no longer exist (a killed run) are removed first."""
    root = Path(tempfile.gettempdir())
    for old in root.glob(f"{RDZV_PREFIX}*-*"):
        try:
            pid = int(old.name[len(RDZV_PREFIX):].split("-", 1)[0])
            if old.stat().st_uid != os.getuid():
                continue
            os.kill(pid, 0)  # raises if no such process
        except ProcessLookupError:
            shutil.rmtree(old, ignore_errors=True)
        except (ValueError, OSError):
            continue
    return tempfile.mkdtemp(prefix=f"{RDZV_PREFIX}{os.getpid()}-")


class TrainerRankError(RuntimeError):
    """A trainer rank died, hung or failed; the run stops (``--resume`` continues from the last checkpoint)."""


class TrainerGroup:
    """``trainer.world_size`` ranks training the policy together (``trainer.strategy``).

    It meets :class:`~rhymerl.training.update.trainer.Trainer`, as the one-process trainer does;
    its :meth:`publish` brings the ranks' new weights into ``model``, the controller's copy
    that the rollout workers are synced from and checkpoints are written from.
    """

    in_process = False  # the ranks are processes of their own

    def __init__(self, cfg: RunConfig, model_path: str | Path, model: CausalLM, *, with_ref: bool,
                 total_optimizer_steps: int) -> None:
        t = cfg.trainer
        self.world_size, self.timeout_s = t.world_size, t.rank_timeout_s
        self.model = model
        self._bad_steps = 0
        self._tmp: str | None = None
        self.handles: list[WorkerHandle] = []
        local = cfg.rollout.backend == "local"
        # the controller's copy of the weights (local backend: shared with rank 0, which writes it)
        self._publish_to = None
        if local:
            self._publish_to = shared_buffer(dict(model.named_parameters()))
            flat, layout = self._publish_to
            with torch.no_grad():
                for (name, p), (_, off, shape) in zip(model.named_parameters(), layout):
                    flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = flat[off:off + p.numel()].view(shape)
        threads = max(1, (os.cpu_count() or 1) // t.world_size)
        specs = [RankSpec(str(model_path), t, cfg.algorithm, rank=r, world_size=t.world_size,
                          device=cfg.model.device if cfg.model.device != "auto" else
                          ("cuda" if torch.cuda.is_available() else "cpu"),
                          with_ref=with_ref, total_optimizer_steps=total_optimizer_steps,
                          temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                          threads=threads,
                          publish_to=self._publish_to if r == 0 else None)
                 for r in range(t.world_size)]
        try:
            if local:
                # A file rendezvous in a folder only this user reads: nothing listens on the network.
                self._tmp = rendezvous_dir()
                # each rank sets its own thread count (RankSpec.threads)
                # torch's compiler stack: the optimizer's constructor and FSDP's sharded tensors
                # import it (1.5 s), once in the server instead of in every rank
                self.handles = spawn_processes(TrainerRank, [(s,) for s in specs], name="rhymerl-trainer",
                                               preload=("torch._dynamo",), timeout=self.timeout_s)
                self._all("setup", f"file://{self._tmp}/store", True, timeout=t.collective_timeout_s + 60)
            else:
                self._start_ray(cfg, specs)
        except BaseException:
            self.close()
            raise

    def _start_ray(self, cfg: RunConfig, specs: list[RankSpec]) -> None:
        import ray

        from rhymerl.distribution.backends import RayHandle, ping_actors

        init_ray(cfg.cluster.address, num_cpus=max(os.cpu_count() or 1, cfg.rollout.workers + self.world_size),
                 threads=specs[0].threads, allow_insecure=cfg.cluster.allow_insecure)
        # On CUDA each rank actor reserves a GPU, so Ray spreads the ranks over the nodes' GPUs
        # (each then sees one device; the rollout workers share them, as in verl's colocation).
        gpus = 1 if specs[0].device.startswith("cuda") else 0
        actor_cls = ray.remote(num_cpus=1, num_gpus=gpus)(TrainerRank)
        self.handles = [RayHandle(r, actor_cls.remote(s)) for r, s in enumerate(specs)]
        ping_actors(self.handles, self.timeout_s, "trainer ranks")
        if cfg.cluster.address:
            init_method = self.handles[0].call("node_address", timeout=60)
            loopback = False
        else:  # a cluster of this machine alone: the file rendezvous, as for local processes
            self._tmp = rendezvous_dir()
            init_method, loopback = f"file://{self._tmp}/store", True
        self._all("setup", init_method, loopback, timeout=cfg.trainer.collective_timeout_s + 60)

    # --- calls to every rank ---------------------------------------------------------------------
    def _all(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Call ``method`` on every rank at once and wait for all; a rank that dies, fails or
        stays silent past the timeout stops every rank and raises :class:`TrainerRankError`."""
        if not self.handles or not all(h.alive for h in self.handles):
            raise TrainerRankError("the trainer ranks are stopped (an earlier failure); resume the run with --resume")
        timeout = self.timeout_s if timeout is None else timeout
        for h in self.handles:
            h.start(method, *args)
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        while len(results) < len(self.handles):
            for h in self.handles:
                if h.index in results or not h.wait_result(0.01):
                    continue
                try:
                    results[h.index] = h.result()
                except (WorkerLost, RuntimeError) as e:
                    self._fail(f"trainer rank {h.index} failed during {method!r}: {_last_line(e)}")
            if len(results) < len(self.handles) and time.monotonic() > deadline:
                silent = [h.index for h in self.handles if h.index not in results]
                self._fail(f"trainer rank(s) {silent} gave no answer to {method!r} in {timeout:.0f}s "
                           "(trainer.rank_timeout_s)")
        return [results[i] for i in range(len(self.handles))]

    def _fail(self, why: str) -> None:
        for h in self.handles:
            h.kill()
        raise TrainerRankError(f"{why}; every trainer rank is stopped. `rhymerl train --resume RUN_DIR` "
                               "continues from the last checkpoint")

    # --- what the controller asks ------------------------------------------------------------------
    def compute_logps(self, exp: Experience) -> None:
        """Fill ``exp.old_logp`` / ``exp.ref_logp``, each rank computing its token-balanced part."""
        parts = self._all("compute_logps", exp)
        N, W = exp.response_mask.shape
        if parts[0][1] is not None:
            exp.old_logp = torch.zeros(N, W)
        if parts[0][2] is not None:
            exp.ref_logp = torch.zeros(N, W)
        for rows, old, ref in parts:
            if old is not None:
                exp.old_logp[rows] = old
            if ref is not None:
                exp.ref_logp[rows] = ref

    def update(self, exp: Experience, step: int, seed: int) -> dict[str, float]:
        """The policy update; each metric is the ranks' weighted sums over their weights, as on one process."""
        parts = self._all("update", exp, step, seed)
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        for s, w, _, _ in parts:
            for k in s:
                sums[k] = sums.get(k, 0.0) + s[k]
                weights[k] = weights.get(k, 0.0) + w[k]
        out = {k: sums[k] / weights[k] for k in sums if weights[k] > 0}
        out["actor/lr"] = parts[0][2]
        self._bad_steps = parts[0][3]
        return out

    def publish(self) -> SyncStats:
        """Bring the new weights into the controller's model: rank 0 gathers them once and writes
        them into the shared buffer (local), or returns them through Ray's object store."""
        t = time.perf_counter()
        res = self._all("publish")[0]
        if isinstance(res, dict):
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # Ray's arrays are read-only; they are only read
                for name, p in self.model.named_parameters():
                    p.copy_(torch.from_numpy(res[name]))
            nbytes = sum(int(a.nbytes) for a in res.values())
        else:
            nbytes = int(res)
        return SyncStats(nbytes, time.perf_counter() - t)

    def gradient(self, exp: Experience) -> dict[str, Any]:
        """The full gradient of ``exp`` as one mini-batch (for ``bench train``)."""
        return self._all("gradient", exp)[0]

    def memory(self) -> list[dict[str, int]]:
        return self._all("memory")

    def save_state(self, folder: Path) -> None:
        self._all("save_state", str(folder))

    def load_state(self, folder: Path, ranks: int = 1) -> None:
        from rhymerl.training.checkpoint import CheckpointError

        errors = [e for e in self._all("load_state", str(folder), ranks) if e]
        if errors:
            raise CheckpointError(errors[0])
        self._bad_steps = self._all("bad_steps")[0]

    @property
    def bad_steps(self) -> int:
        return self._bad_steps

    @bad_steps.setter
    def bad_steps(self, n: int) -> None:
        self._all("set_bad_steps", n)
        self._bad_steps = n

    def close(self) -> None:
        """Stop every rank (idempotent)."""
        for h in self.handles:
            if h.alive:
                try:
                    h.call("shutdown", timeout=10)
                except Exception:  # noqa: BLE001 - stopping anyway
                    pass
                h.kill()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def _last_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(e).__name__
