"""Build the rollout side of a run from its config: workers, their backend, the coordinator."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Mapping

import torch

from rhymerl.config import RunConfig
from rhymerl.distribution.backends import make_pool
from rhymerl.distribution.coordinator import RolloutCoordinator
from rhymerl.distribution.work import WorkerSpec
from rhymerl.scheduling import StepCost

log = logging.getLogger(__name__)


def in_process_worker(cfg: RunConfig) -> bool:
    """One local worker runs in the controller's process, except under async RL or a streamed
    update: there it generates while the controller trains, and a process of its own keeps its
    numerics apart (two threads of one process share torch's thread pool, which changes float
    results with timing) and its work off the controller's interpreter lock."""
    r = cfg.rollout
    return (r.workers == 1 and r.backend == "local" and cfg.trainer.async_staleness == 0
            and not cfg.trainer.stream_update)


def worker_specs(cfg: RunConfig, model_path: str | Path) -> list[WorkerSpec]:
    r = cfg.rollout
    R = r.workers
    speculative = r.speculative if r.speculative.method != "none" else None
    device = cfg.model.device
    if device in ("auto", "cuda") and torch.cuda.is_available():
        devices = [f"cuda:{i % torch.cuda.device_count()}" for i in range(R)]
    else:
        devices = ["cpu" if device == "auto" else device] * R
    in_process = in_process_worker(cfg)
    # Async RL and a streamed update train while the workers generate: the trainer keeps a share
    # of the cores (on 2 cores a 2-thread worker beside the 2-thread trainer slowed both 3-12x).
    sharers = R + (1 if cfg.trainer.async_staleness or cfg.trainer.stream_update else 0)
    threads = r.threads or (0 if in_process else max(1, (os.cpu_count() or 1) // sharers))
    return [WorkerSpec(str(model_path), max_num_seqs=r.max_num_seqs, max_model_len=r.max_model_len,
                       device=devices[i], dtype=cfg.model.dtype, speculative=speculative, threads=threads,
                       seed=cfg.seed + i, invariant=r.invariant) for i in range(R)]


def trainer_threads_beside_workers(cfg: RunConfig) -> int:
    """Torch threads for the trainer's work beside the rollout (a streamed update, async RL's
    update): the cores this machine's CPU workers leave, at least one; 0 (torch's default)
    where the workers are not on this machine's cores (GPUs, a cluster of its own)."""
    if in_process_worker(cfg) or cfg.cluster.address:
        return 0
    specs = worker_specs(cfg, "")
    if any(s.device != "cpu" for s in specs):
        return 0
    return max(1, (os.cpu_count() or 1) - sum(s.threads for s in specs))


def profile_cost(model_path: str | Path, cfg: RunConfig, threads: int) -> StepCost:
    """The workers' step-time curve, measured once on this machine with a worker's thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        top = min(cfg.rollout.max_num_seqs, 256)
        # Six points: the plan's allocation reads the curve's shape between them, and a coarse
        # grid (it was 1, top/8, top/2, top) let one noisy timing bend it (measured in bench pipe).
        batches = tuple(sorted({1, max(1, top // 32), max(1, top // 8), max(1, top // 4), max(1, top // 2), top}))
        dev = "cpu" if not torch.cuda.is_available() else "cuda"
        return StepCost.profile(str(model_path), batches=batches, device=dev, name="profiled worker")
    finally:
        torch.set_num_threads(before)


def build_coordinator(cfg: RunConfig, model_path: str | Path, named: Mapping[str, torch.Tensor], *,
                      tokenizer=None, history=None) -> RolloutCoordinator:
    """Start the workers (loaded from ``model_path``, then synced to ``named``) and their coordinator."""
    r = cfg.rollout
    specs = worker_specs(cfg, model_path)
    cost = None
    if r.workers > 1 and r.schedule == "histopipe":
        cost = profile_cost(model_path, cfg, specs[0].threads)
        log.info("worker cost curve: %s", cost.to_dict())
    pool = make_pool(r.backend, specs, named, address=cfg.cluster.address, in_process=in_process_worker(cfg))
    return RolloutCoordinator(pool, policy=r.schedule, history=history, cost=cost, max_num_seqs=r.max_num_seqs,
                              length_stat=r.length_stat, tail_fraction=r.tail_fraction,
                              worker_timeout_s=r.worker_timeout_s, complementary=r.complementary,
                              migrate=r.migrate, placement=r.placement, tokenizer=tokenizer,
                              # a streamed update starts on each group as it lands
                              report_finished=cfg.trainer.stream_update)
