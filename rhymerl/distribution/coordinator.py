"""The rollout coordinator: one RL step's generation over R workers, inside the step barrier.

controller -> workers -> results: it plans the step (:mod:`rhymerl.scheduling`), hands each
worker its work items with the history they draft from, drives the workers in short slices,
streams finished prompts back to the caller (rewards start while others still generate),
moves tail samples to idle workers, and re-runs the work of a worker that dies or hangs.
Sampling is keyed by (seed, sample, position), so where a sample runs never changes its tokens.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from rhymerl.distribution.backends import WorkerHandle, WorkerPool
from rhymerl.distribution.work import WorkerLost, WorkerReport, WorkItem
from rhymerl.engine.llm_engine import EngineStats
from rhymerl.engine.outputs import CompletionOutput, RequestOutput
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.scheduling import StepCost, make_plan
from rhymerl.scheduling.length_predictor import predicted_samples
from rhymerl.scheduling.planner import Plan

log = logging.getLogger(__name__)


@dataclass
class RolloutRequest:
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    prompt_key: str | None = None


@dataclass
class PipeStats:
    """Counters of the scheduler, cumulative."""

    migrations: int = 0  # running samples moved (KV recomputed on the new worker)
    steals: int = 0  # waiting samples taken by an idle worker
    lost_workers: int = 0
    rerun_samples: int = 0  # samples re-run because their worker was lost


class RolloutCoordinator:
    """Drives a :class:`WorkerPool` through rollout steps.

    Args:
        pool: the workers.
        policy: ``even`` | ``least_loaded`` | ``histopipe`` | ``oracle`` (see :mod:`rhymerl.scheduling.planner`).
        history: the controller's history store: drafts for the workers, length predictions,
            and where finished responses are recorded (None: neither).
        cost: the workers' step-time curve (plans and migration decisions); None: a flat curve.
        max_num_seqs: slots per worker.
        length_stat: how a prompt's previous lengths predict its next (``mean`` | ``max`` | ...).
        tail_fraction: tail migration starts once at most this share of the samples is unfinished.
        worker_timeout_s: a call running longer than this means the worker hangs: it is killed.
        slice_s: how long a worker runs between reports.
        placement: how histopipe places its groups (``auto`` | ``lpt`` | ``contiguous``).
    """

    def __init__(self, pool: WorkerPool, *, policy: str = "histopipe", history=None, cost: StepCost | None = None,
                 max_num_seqs: int = 64, length_stat: str = "mean", tail_fraction: float = 0.1,
                 worker_timeout_s: float = 300.0, slice_s: float = 0.05, complementary: bool = True,
                 migrate: bool = True, placement: str = "auto", tokenizer=None) -> None:
        self.pool, self.policy, self.history = pool, policy, history
        self.cost = cost or StepCost((1, 2), (1.0, 1.0))
        self.max_num_seqs, self.length_stat = max_num_seqs, length_stat
        self.tail_fraction, self.worker_timeout_s, self.slice_s = tail_fraction, worker_timeout_s, slice_s
        self.complementary, self.migrate, self.tokenizer = complementary, migrate, tokenizer
        self.placement = placement
        self.stats = EngineStats()
        self.pipe = PipeStats()
        self.last_plan: Plan | None = None
        self.busy_s: dict[int, float] = defaultdict(float)  # engine time per worker, cumulative
        self.on_report: Callable[[WorkerHandle, WorkerReport], None] | None = None  # test hook
        self._next_item = 0

    @property
    def num_workers(self) -> int:
        return len(self.pool.alive())

    # --- planning -----------------------------------------------------------------------
    def plan(self, requests: list[RolloutRequest], step: int, policy: str | None = None,
             true_lengths: list[list[int]] | None = None) -> Plan:
        policy = policy or self.policy
        alive = self.pool.alive()
        n = [r.params.n for r in requests]
        if policy == "oracle":
            if true_lengths is None:
                raise ValueError("the oracle policy needs the true lengths")
            lengths: list[list[float]] = [list(map(float, x)) for x in true_lengths]
        else:
            hist = [self.history.lengths(r.prompt_key) if self.history is not None and r.prompt_key else []
                    for r in requests]
            lengths = predicted_samples(hist, n, self.length_stat)
        plan = make_plan(policy, lengths, len(alive), cost=self.cost, max_num_seqs=self.max_num_seqs, step=step,
                         complementary=self.complementary, migrate=self.migrate, placement=self.placement,
                         prompt_len=float(np.mean([len(r.prompt_ids) for r in requests])) if requests else 0.0)
        return plan

    # --- one step ----------------------------------------------------------------------------
    def rollout(self, requests: list[RolloutRequest], step: int, *, plan: Plan | None = None,
                on_done: Callable[[int, RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Generate every request; returns outputs in request order.

        ``on_done(i, output)`` is called as soon as request i has all its samples.
        """
        plan = plan or self.plan(requests, step)
        self.last_plan = plan
        alive = self.pool.alive()
        P = len(requests)
        results: list[dict[int, CompletionOutput]] = [dict() for _ in range(P)]
        outs: list[RequestOutput | None] = [None] * P
        total = sum(r.params.n for r in requests)
        done_samples = 0
        item_prompt: dict[int, int] = {}
        where: dict[tuple[int, int], int] = {}  # (prompt, sample) -> worker index, while unfinished
        pending: dict[int, list[WorkItem]] = defaultdict(list)
        outstanding: dict[int, int] = defaultdict(int)
        pred = plan.predicted if plan.predicted is not None else np.zeros(P)

        def new_item(p: int, samples: list[int], w: int, prefixes=None) -> None:
            r = requests[p]
            iid = self._next_item
            self._next_item += 1
            item_prompt[iid] = p
            hist = self.history.export(r.prompt_key) if self.history is not None and r.prompt_key else []
            pending[w].append(WorkItem(iid, r.prompt_ids, r.params, r.seed, r.prompt_key, samples,
                                       prefixes or {}, hist))
            for s in samples:
                where[(p, s)] = w
            outstanding[w] += len(samples)

        for h, units in zip(alive, plan.workers):
            for u in units:
                new_item(u.prompt, list(u.samples), h.index)

        def finish(p: int) -> None:
            r = requests[p]
            o = RequestOutput(request_id=p, prompt_token_ids=list(r.prompt_ids), prompt_key=r.prompt_key,
                              outputs=[results[p][s] for s in sorted(results[p])])
            outs[p] = o
            if on_done is not None:
                on_done(p, o)

        def absorb(h: WorkerHandle, rep: WorkerReport) -> None:
            nonlocal done_samples
            st = self.stats
            for k in ("forwards", "prefills", "generated", "drafted", "accepted", "draft_s", "step_s"):
                setattr(st, k, getattr(st, k) + rep.stats[k])
            st.batch_sizes.extend(rep.stats["batch_sizes"])
            self.busy_s[h.index] += rep.stats["step_s"]
            for it in rep.finished:
                p = item_prompt.pop(it.item_id)
                if it.error is not None:
                    raise ValueError(f"request {p} ({requests[p].prompt_key}): {it.error}")
                for c in it.outputs:
                    results[p][c.index] = c
                    where.pop((p, c.index), None)
                    outstanding[h.index] -= 1
                    done_samples += 1
                if len(results[p]) == requests[p].params.n:
                    finish(p)

        def lose(h: WorkerHandle, why: str) -> None:
            self.pipe.lost_workers += 1
            log.warning("rollout worker %d lost (%s); its unfinished samples re-run on the others with the "
                        "same seeds", h.index, why)
            h.kill()
            orphans: dict[int, list[int]] = defaultdict(list)
            for (p, s), w in list(where.items()):
                if w == h.index:
                    orphans[p].append(s)
            for it in pending.pop(h.index, []):
                item_prompt.pop(it.item_id, None)
            outstanding[h.index] = 0
            live = self.pool.alive()
            if not live:
                raise RuntimeError(f"every rollout worker is lost (last: {why})")
            for p, samples in sorted(orphans.items()):
                w = min(live, key=lambda x: outstanding[x.index]).index
                new_item(p, sorted(samples), w)
                self.pipe.rerun_samples += len(samples)

        def idle_workers() -> list[WorkerHandle]:
            return [x for x in self.pool.alive() if x.started_at is None and outstanding[x.index] == 0
                    and not pending[x.index]]

        def rebalance(h: WorkerHandle, rep: WorkerReport) -> None:
            """An idle worker takes waiting work from ``h``, or, in the tail, its most overdue sample."""
            idle = idle_workers()
            if not plan.migrate or not idle:
                return
            target = idle[0]
            if rep.waiting:
                iid = rep.waiting[-1][0]
                p = item_prompt.get(iid)
                samples = [s for i, s in rep.waiting if i == iid]
                taken = [s for s in samples if h.call("abort", iid, s) is not None]
                if taken and p is not None:
                    outstanding[h.index] -= len(taken)
                    new_item(p, taken, target.index)
                    self.pipe.steals += len(taken)
                return
            if total - done_samples > self.tail_fraction * total or len(rep.running) < 2:
                return
            best, over = None, 0.0
            for iid, s, gen in rep.running:
                p = item_prompt.get(iid)
                if p is None:
                    continue
                o = gen - float(pred[p])
                if o > over:
                    best, over = (iid, p, s, gen), o
            if best is None:
                return
            iid, p, s, gen = best
            B = len(rep.running)
            recompute = (len(requests[p].prompt_ids) + gen) * self.cost.prefill_per_token_s
            if (self.cost.step_s(B) - self.cost.step_s(1)) * gen <= recompute:
                return
            got = h.call("abort", iid, s)
            if got is None:
                return
            outstanding[h.index] -= 1
            new_item(p, [s], target.index, {s: got})
            self.pipe.migrations += 1

        def kick(h: WorkerHandle) -> None:
            if h.alive and h.started_at is None and (pending[h.index] or outstanding[h.index] > 0):
                items = pending.pop(h.index, [])
                try:
                    h.start("advance", items, step, self.slice_s)
                except WorkerLost as e:
                    lose(h, str(e))

        for h in alive:
            kick(h)
        while any(o is None for o in outs):
            if all(h.started_at is None for h in self.pool.alive()):  # a bookkeeping bug, never a hang
                missing = {p: sorted(set(range(requests[p].params.n)) - set(results[p]))
                           for p, o in enumerate(outs) if o is None}
                raise RuntimeError(f"rollout stalled: samples {missing} are on no worker")
            for h in self.pool.wait(timeout=min(1.0, self.worker_timeout_s)):
                try:
                    rep = h.result()
                except WorkerLost as e:
                    lose(h, str(e))
                    continue
                absorb(h, rep)
                if self.on_report is not None:
                    self.on_report(h, rep)
                if h.alive:
                    try:
                        rebalance(h, rep)
                    except WorkerLost as e:
                        lose(h, str(e))
            now = time.monotonic()
            for h in self.pool.alive():
                if h.started_at is not None and now - h.started_at > self.worker_timeout_s:
                    lose(h, f"no answer for {now - h.started_at:.0f}s (worker_timeout_s={self.worker_timeout_s})")
            for h in self.pool.alive():
                kick(h)
            if not self.pool.alive():
                raise RuntimeError("every rollout worker is lost")
        if self.history is not None:
            for r, o in zip(requests, outs):
                if r.prompt_key is not None and o is not None:
                    self.history.add(r.prompt_key, r.prompt_ids, [c.token_ids for c in o.outputs], step)
        return outs  # type: ignore[return-value]

    # --- LLM-compatible entry point (evaluation) ------------------------------------------------
    def generate(self, prompts: Iterable[str | list[int]], sampling_params: SamplingParams | None = None, *,
                 prompt_keys: list[str] | None = None, step: int = -1, use_tqdm: bool = False,
                 policy: str = "least_loaded") -> list[RequestOutput]:
        """Like :meth:`rhymerl.engine.LLM.generate` (no history is recorded without prompt keys)."""
        from rhymerl.tokenizer import encode_prompt

        params = sampling_params or SamplingParams()
        reqs = []
        for i, pr in enumerate(prompts):
            ids = pr if isinstance(pr, list) and (not pr or isinstance(pr[0], int)) else \
                encode_prompt(self.tokenizer, pr)  # type: ignore[arg-type]
            seed = params.seed if params.seed is not None else i
            reqs.append(RolloutRequest(list(ids), params, seed, prompt_keys[i] if prompt_keys else None))
        hist, self.history = self.history, (self.history if prompt_keys else None)
        try:
            return self.rollout(reqs, step, plan=self.plan(reqs, step, policy=policy))
        finally:
            self.history = hist
