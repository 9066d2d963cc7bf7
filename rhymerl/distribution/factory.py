"""Build the rollout side of a run from its config: workers, their backend, the coordinator."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from rhymerl.config import RunConfig
from rhymerl.distribution.backends import make_pool
from rhymerl.distribution.coordinator import RolloutCoordinator
from rhymerl.distribution.work import WorkerSpec
from rhymerl.engine import SamplingParams
from rhymerl.llm import LLM
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
    # of the cores (threads spinning on a shared core slow both sides many times over).
    sharers = R + (1 if cfg.trainer.async_staleness or cfg.trainer.stream_update else 0)
    threads = r.threads or (0 if in_process else max(1, (os.cpu_count() or 1) // sharers))
    return [WorkerSpec(str(model_path), max_num_seqs=r.max_num_seqs, max_model_len=r.max_model_len,
                       device=devices[i], dtype=cfg.model.dtype, speculative=speculative, threads=threads,
                       seed=cfg.seed + i, invariant=r.invariant, engine=r.engine,
                       timeout_s=r.worker_timeout_s) for i in range(R)]


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


def profile_engine(model, *, batches: tuple[int, ...] = (1, 4, 16, 64, 128), tokens: int = 24,
                   prompt_len: int = 40, device: str = "cpu", name: str = "profiled",
                   typical: bool = False) -> StepCost:
    """Measure a plain (no speculation) engine on ``model`` at each batch size.

    Times whole ``generate`` calls of ``tokens`` forced tokens (EOS ignored) and divides by
    the decode steps; the prefill cost per token comes from a batch of prompts. Each time is
    the best of three calls, or with ``typical`` their median (what a run's steps cost on a
    machine whose speed varies, rather than its best case).
    """
    llm = LLM(model, max_num_seqs=max(batches), max_model_len=prompt_len + tokens + 8, device=device)
    vocab = llm.model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, size=prompt_len).tolist() for _ in range(max(batches))]
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)  # the prefill alone
    llm.generate(prompts[:4], sp, use_tqdm=False)  # warm-up

    def timed(batch: list, params: SamplingParams, reps: int = 3) -> float:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            times.append(time.perf_counter() - t)
        return float(np.median(times)) if typical else min(times)

    secs = []
    for B in batches:
        # decode steps only: the same batch with and without its tokens after the first
        secs.append(max(1e-6, (timed(prompts[:B], sp) - timed(prompts[:B], one)) / (tokens - 1)))
    group = prompts[: min(32, len(prompts))]  # prefill as the engine runs it: a batch of prompts
    prefill = timed(group, one, 3) / (len(group) * prompt_len)
    return StepCost(tuple(batches), tuple(secs), prefill, name)


def profile_cost(model_path: str | Path, cfg: RunConfig, threads: int) -> StepCost:
    """The workers' step-time curve, measured once on this machine with a worker's thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        top = min(cfg.rollout.max_num_seqs, 256)
        # Six points: the plan's allocation reads the curve's shape between them, and a coarser
        # grid lets one noisy timing bend it.
        batches = tuple(sorted({1, max(1, top // 32), max(1, top // 8), max(1, top // 4), max(1, top // 2), top}))
        dev = "cpu" if not torch.cuda.is_available() else "cuda"
        return profile_engine(str(model_path), batches=batches, device=dev, name="profiled worker")
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
    pool = make_pool(r.backend, specs, named, address=cfg.cluster.address, in_process=in_process_worker(cfg),
                     timeout_s=r.worker_timeout_s, allow_insecure=cfg.cluster.allow_insecure)
    # local CPU worker processes share this machine's cores (what the simulator must price)
    shared = r.backend == "local" and not cfg.cluster.address and all(s.device == "cpu" for s in specs)
    return RolloutCoordinator(pool, policy=r.schedule, history=history, cost=cost, max_num_seqs=r.max_num_seqs,
                              cores=float(os.cpu_count() or 1) if shared else None, threads=max(1, specs[0].threads),
                              length_stat=r.length_stat, tail_fraction=r.tail_fraction,
                              worker_timeout_s=r.worker_timeout_s, complementary=r.complementary,
                              migrate=r.migrate, placement=r.placement, tokenizer=tokenizer,
                              # a streamed update starts on each group as it lands
                              report_finished=cfg.trainer.stream_update)
