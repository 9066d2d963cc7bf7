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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from rhymerl.distribution.backends import WorkerHandle, WorkerPool
from rhymerl.distribution.work import ENGINE_COUNTERS, WorkerLost, WorkerReport, WorkItem
from rhymerl.engine.llm_engine import EngineStats
from rhymerl.engine.outputs import CompletionOutput, RequestOutput
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.scheduling import StepCost, make_plan, simulate
from rhymerl.scheduling.length_predictor import log_error_sigma, predicted_samples
from rhymerl.scheduling.placement_scores import PlacementScores
from rhymerl.scheduling.plan import Plan
from rhymerl.scheduling.planner import ORACLES

log = logging.getLogger(__name__)


@dataclass
class RolloutRequest:
    """One prompt's samples for this step.

    ``samples`` limits the step to these sample indices (default: all ``params.n``), and
    ``prefixes`` gives some of them the tokens and log-probs they already have: they continue
    from there with the same seeded draws (a group paused at the end of the previous step).
    """

    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    prompt_key: str | None = None
    samples: tuple[int, ...] | None = None
    prefixes: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)

    def sample_indices(self) -> list[int]:
        return list(range(self.params.n)) if self.samples is None else sorted(self.samples)


@dataclass
class PipeStats:
    """Counters of the scheduler, cumulative."""

    migrations: int = 0  # running samples moved (KV recomputed on the new worker)
    steals: int = 0  # waiting samples taken by an idle worker
    lost_workers: int = 0
    rerun_samples: int = 0  # samples re-run because their worker was lost


def _shape(requests: list[RolloutRequest]) -> dict[str, Any]:
    """What plans are priced with besides lengths: the mean prompt and the length limit."""
    return {"prompt_len": float(np.mean([len(r.prompt_ids) for r in requests])) if requests else 0.0,
            "max_tokens": max((r.params.max_tokens for r in requests), default=None)}


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
        report_finished: a worker also reports as soon as one of its groups is whole (for a
            caller that starts work on each group as it lands: a streamed update), at the cost
            of a round trip per group.
        placement: how histopipe places its groups (one of ``planner.PLACEMENTS``; ``auto``: learnt).
        cores, threads: the workers share this many cores, ``threads`` each (local worker
            processes on one machine; None: each worker has a device of its own): the simulator
            that checks its prices against the workers' measured time needs to know.

    ``length_error_sigma`` is the coordinator's own measure of how well its last histopipe
    plan predicted (log error of the prompts' mean lengths); the next plan prices it in.
    """

    def __init__(self, pool: WorkerPool, *, policy: str = "histopipe", history=None, cost: StepCost | None = None,
                 max_num_seqs: int = 64, length_stat: str = "mean", tail_fraction: float = 0.1,
                 worker_timeout_s: float = 300.0, slice_s: float = 0.05, complementary: bool = True,
                 migrate: bool = True, placement: str = "auto", tokenizer=None,
                 report_finished: bool = False, cores: float | None = None, threads: int = 1) -> None:
        self.pool, self.policy, self.history = pool, policy, history
        self.cost = cost or StepCost((1, 2), (1.0, 1.0))
        self.max_num_seqs, self.length_stat = max_num_seqs, length_stat
        self.tail_fraction, self.worker_timeout_s, self.slice_s = tail_fraction, worker_timeout_s, slice_s
        self.complementary, self.migrate, self.tokenizer = complementary, migrate, tokenizer
        self.placement, self.report_finished = placement, report_finished
        self.cores, self.threads = cores, threads
        self.length_error_sigma = 0.0
        self._placements = PlacementScores()  # placement "auto": learnt from the steps run (scheduling/)
        # Scoring a finished step's placements runs beside whatever comes next (training, the next
        # rollout's workers); the next plan, or a reader of the scores, waits for it.
        self._learner: ThreadPoolExecutor | None = None
        self._learning: Future | None = None
        self.stats = EngineStats()
        self.source_stats: dict[str, float] = {}  # "accepted/<source>", "drafted/<source>", cumulative
        self.pipe = PipeStats()
        self.busy_s: dict[int, float] = defaultdict(float)  # engine time per worker, cumulative
        self.on_report: Callable[[WorkerHandle, WorkerReport], None] | None = None  # test hook
        self._next_item = 0

    @property
    def placements(self) -> PlacementScores:
        """HistoPipe's placement scores, with every finished step's scoring in."""
        if self._learning is not None:
            done, self._learning = self._learning, None
            done.result()  # an error in scoring surfaces here
        return self._placements

    def placement_state(self) -> dict[str, Any]:
        """What HistoPipe learnt of placements and of its own prediction error (a checkpoint's)."""
        sc = self.placements
        return {"scores": dict(sc.scores), "steps": sc.steps, "share_error_sq": sc.share_error_sq,
                "length_error_sigma": self.length_error_sigma}

    def load_placement_state(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`placement_state` (an empty dict: start cold, as an old checkpoint)."""
        if not state:
            return
        sc = self.placements
        sc.scores = {str(k): float(v) for k, v in state["scores"].items()}
        sc.steps = int(state["steps"])
        sc.share_error_sq = None if state["share_error_sq"] is None else float(state["share_error_sq"])
        self.length_error_sigma = float(state["length_error_sigma"])

    @property
    def num_workers(self) -> int:
        return len(self.pool.alive())

    # --- planning -----------------------------------------------------------------------
    def plan(self, requests: list[RolloutRequest], step: int, policy: str | None = None,
             true_lengths: list[list[int]] | None = None) -> Plan:
        policy = policy or self.policy
        alive = self.pool.alive()
        n = [r.params.n for r in requests]  # a request continuing some samples is planned whole: an overestimate
        if policy in ORACLES:
            if true_lengths is None:
                raise ValueError(f"the {policy} policy needs the true lengths")
            lengths: list[list[float]] = [list(map(float, x)) for x in true_lengths]
        else:
            hist = [self.history.lengths(r.prompt_key) if self.history is not None and r.prompt_key else []
                    for r in requests]
            lengths = predicted_samples(hist, n, self.length_stat)
        placement, migrate = self.placement, self.migrate
        if placement == "auto" and policy == "histopipe":
            placement, learnt_migrate = self.placements.choose()
            migrate = migrate and learnt_migrate
        plan = make_plan(policy, lengths, len(alive), cost=self.cost, max_num_seqs=self.max_num_seqs, step=step,
                         complementary=self.complementary, migrate=migrate, placement=placement,
                         error_sigma=self.length_error_sigma, **_shape(requests))
        if policy not in ORACLES:
            plan.known = np.array([len(h) > 0 for h in hist], dtype=bool)
            plan.lengths = lengths
        return plan

    # --- one step ----------------------------------------------------------------------------
    def rollout(self, requests: list[RolloutRequest], step: int, *, plan: Plan | None = None,
                on_done: Callable[[int, RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Generate every request; returns outputs in request order.

        ``on_done(i, output)`` is called as soon as request i has all its samples (after the
        workers that reported it are sent on).
        """
        plan = plan or self.plan(requests, step)
        workers = [h.index for h in self.pool.alive()]
        busy0 = [self.busy_s[i] for i in workers]
        outs = _StepRun(self, requests, step, plan, on_done).run()
        busy = [self.busy_s[i] - b for i, b in zip(workers, busy0)]
        if plan.policy == "histopipe" and plan.known is not None and plan.predicted is not None:
            k = [i for i, o in enumerate(outs) if plan.known[i] and o.error is None and o.outputs]
            if len(k) >= 2:
                true = [np.mean([len(c.token_ids) for c in outs[i].outputs]) for i in k]
                self.length_error_sigma = log_error_sigma(plan.predicted[k], true)
            self._learn_placement(plan, requests, outs, busy if len(workers) == len(self.pool.alive()) else None)
        return outs

    def _learn_placement(self, plan: Plan, requests: list[RolloutRequest], outs: list[RequestOutput],
                         busy: list[float] | None) -> None:
        """Score each placement on this step's actual lengths (only a complete step: every sample),
        and check the simulator against each worker's measured busy time (``busy``; None when a
        worker was lost); on the learner thread, after the previous step's scoring."""
        if self.placement != "auto" or len(plan.workers) < 2 or plan.lengths is None or plan.known is None \
                or not plan.known.any():  # one worker: every placement is the same
            return
        actual = [[len(c.token_ids) for c in o.outputs] for o in outs]
        if any(o.error is not None or len(a) != len(p) for o, a, p in zip(outs, actual, plan.lengths)):
            return
        scores, cost, shape = self.placements, self.cost, _shape(requests)
        kw = {"max_num_seqs": self.max_num_seqs, "cores": self.cores, "threads": self.threads}
        sigma, prompt_lens = self.length_error_sigma, [len(r.prompt_ids) for r in requests]

        def score() -> None:
            scores.observe(plan.lengths, actual, len(plan.workers), cost=cost, error_sigma=sigma, **kw, **shape)
            if busy is not None and len(busy) == len(plan.workers):
                scores.observe_shares(busy, simulate(plan, actual, prompt_lens, cost, **kw).busy_s)

        if self._learner is None:
            self._learner = ThreadPoolExecutor(1, thread_name_prefix="rhymerl-placement")
        self._learning = self._learner.submit(score)

    # --- LLM-compatible entry point (evaluation) ------------------------------------------------
    def generate(self, prompts: Iterable[str | list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 prompt_keys: list[str] | None = None, step: int = -1, use_tqdm: bool = False,
                 policy: str = "least_loaded") -> list[RequestOutput]:
        """Like :meth:`rhymerl.llm.LLM.generate` (no history is recorded without prompt keys)."""
        from rhymerl.tokenizer import encode_prompt

        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        reqs = []
        for i, (pr, sp) in enumerate(zip(prompts, plist)):
            ids = pr if isinstance(pr, list) and (not pr or isinstance(pr[0], int)) else \
                encode_prompt(self.tokenizer, pr)  # type: ignore[arg-type]
            seed = sp.seed if sp.seed is not None else i
            reqs.append(RolloutRequest(list(ids), sp, seed, prompt_keys[i] if prompt_keys else None))
        outs = self.rollout(reqs, step, plan=self.plan(reqs, step, policy=policy))
        if self.history is not None and prompt_keys:  # used standalone, it records like LLM.generate
            for r, o in zip(reqs, outs):
                if o.error is None and o.outputs:
                    self.history.add(r.prompt_key, r.prompt_ids, [c.token_ids for c in o.outputs], step)
        return outs


class _StepRun:
    """The bookkeeping of one rollout step: which samples are where, what is back."""

    def __init__(self, co: RolloutCoordinator, requests: list[RolloutRequest], step: int, plan: Plan,
                 on_done: Callable[[int, RequestOutput], None] | None) -> None:
        self.co, self.requests, self.step, self.plan, self.on_done = co, requests, step, plan, on_done
        P = len(requests)
        self.results: list[dict[int, CompletionOutput]] = [dict() for _ in range(P)]
        self.outs: list[RequestOutput | None] = [None] * P
        self.need = [len(r.sample_indices()) for r in requests]
        self.total = sum(self.need)
        self.done_samples = 0
        self.item_prompt: dict[int, int] = {}
        self.where: dict[tuple[int, int], int] = {}  # (prompt, sample) -> worker index, while unfinished
        self.pending: dict[int, list[WorkItem]] = defaultdict(list)  # items not yet sent, per worker
        self.outstanding: dict[int, int] = defaultdict(int)  # unfinished samples per worker
        # Whole requests not yet handed to on_done: the callback (scoring, a streamed update's
        # hand-off) runs after the workers are sent on, so they never wait for it.
        self.ready: list[int] = []
        self.pred = plan.predicted if plan.predicted is not None else np.zeros(P)
        wanted = [set(r.sample_indices()) for r in requests]
        for h, units in zip(co.pool.alive(), plan.workers):
            for u in units:
                samples = [s for s in u.samples if s in wanted[u.prompt]]
                if samples:
                    pre = requests[u.prompt].prefixes
                    self.new_item(u.prompt, samples, h.index, {s: pre[s] for s in samples if s in pre})

    def run(self) -> list[RequestOutput]:
        co = self.co
        for h in co.pool.alive():
            self.kick(h)
        while any(o is None for o in self.outs):
            if all(h.started_at is None for h in co.pool.alive()):  # a bookkeeping bug, never a hang
                missing = {p: sorted(set(self.requests[p].sample_indices()) - set(self.results[p]))
                           for p, o in enumerate(self.outs) if o is None}
                raise RuntimeError(f"rollout stalled: samples {missing} are on no worker")
            for h in co.pool.wait(timeout=min(1.0, co.worker_timeout_s)):
                try:
                    rep = h.result()
                except WorkerLost as e:
                    self.lose(h, str(e))
                    continue
                self.absorb(h, rep)
                self.check_accounted(h, rep)
                if co.on_report is not None:
                    co.on_report(h, rep)
                if h.alive:
                    try:
                        self.rebalance(h, rep)
                    except WorkerLost as e:
                        self.lose(h, str(e))
            now = time.monotonic()
            for h in co.pool.alive():
                if h.started_at is not None and now - h.started_at > co.worker_timeout_s:
                    self.lose(h, f"no answer for {now - h.started_at:.0f}s (worker_timeout_s={co.worker_timeout_s})")
            for h in co.pool.alive():
                self.kick(h)
            if not co.pool.alive():
                raise RuntimeError("every rollout worker is lost")
            self.hand_over()
        self.hand_over()
        return self.outs  # type: ignore[return-value]

    def hand_over(self) -> None:
        """``on_done`` for every request that became whole since the last call."""
        ready, self.ready = self.ready, []
        if self.on_done is not None:
            for p in ready:
                self.on_done(p, self.outs[p])

    def new_item(self, p: int, samples: list[int], w: int, prefixes=None) -> None:
        co, r = self.co, self.requests[p]
        iid = co._next_item
        co._next_item += 1
        self.item_prompt[iid] = p
        hist = co.history.export(r.prompt_key) if co.history is not None and r.prompt_key else []
        self.pending[w].append(WorkItem(iid, r.prompt_ids, r.params, r.seed, r.prompt_key, samples,
                                        prefixes or {}, hist))
        for s in samples:
            self.where[(p, s)] = w
        self.outstanding[w] += len(samples)

    def kick(self, h: WorkerHandle) -> None:
        """Send the worker its new items and let it run a slice, if it has anything to do."""
        if h.alive and h.started_at is None and (self.pending[h.index] or self.outstanding[h.index] > 0):
            try:
                h.start("advance", self.pending.pop(h.index, []), self.step, self.co.slice_s,
                        self.co.report_finished)
            except WorkerLost as e:
                self.lose(h, str(e))

    def absorb(self, h: WorkerHandle, rep: WorkerReport) -> None:
        st = self.co.stats
        for k in ENGINE_COUNTERS:
            setattr(st, k, getattr(st, k) + rep.stats[k])
        for k, v in rep.stats.items():
            if "/" in k:  # per draft source ("accepted/<source>", "drafted/<source>")
                self.co.source_stats[k] = self.co.source_stats.get(k, 0) + v
        self.co.busy_s[h.index] += rep.stats["step_s"]
        for it in rep.finished:
            p = self.item_prompt.pop(it.item_id)
            if it.error is not None:
                raise ValueError(f"request {p} ({self.requests[p].prompt_key}): {it.error}")
            for c in it.outputs:
                self.results[p][c.index] = c
                self.where.pop((p, c.index), None)
                self.outstanding[h.index] -= 1
                self.done_samples += 1
            if len(self.results[p]) == self.need[p]:
                self.finish(p)

    def check_accounted(self, h: WorkerHandle, rep: WorkerReport) -> None:
        """A worker that holds none of the samples recorded on it has lost them: a bookkeeping bug,
        raised rather than kicking the worker forever."""
        if self.outstanding[h.index] > 0 and not rep.running and not rep.waiting and not self.pending[h.index]:
            lost = sorted((p, s) for (p, s), w in self.where.items() if w == h.index)
            raise RuntimeError(f"rollout stalled: worker {h.index} holds no unfinished sample, but "
                               f"{self.outstanding[h.index]} are recorded on it (prompt, sample): {lost}")

    def finish(self, p: int) -> None:
        r = self.requests[p]
        o = RequestOutput(request_id=p, prompt_token_ids=list(r.prompt_ids), prompt_key=r.prompt_key,
                          outputs=[self.results[p][s] for s in sorted(self.results[p])])
        self.outs[p] = o
        self.ready.append(p)

    def lose(self, h: WorkerHandle, why: str) -> None:
        """A worker is gone: its unfinished samples go to the least loaded survivors, same seeds."""
        co = self.co
        co.pipe.lost_workers += 1
        log.warning("rollout worker %d lost (%s); its unfinished samples re-run on the others with the "
                    "same seeds", h.index, why)
        h.kill()
        orphans: dict[int, list[int]] = defaultdict(list)
        for (p, s), w in list(self.where.items()):
            if w == h.index:
                orphans[p].append(s)
        for it in self.pending.pop(h.index, []):
            self.item_prompt.pop(it.item_id, None)
        self.outstanding[h.index] = 0
        live = co.pool.alive()
        if not live:
            raise RuntimeError(f"every rollout worker is lost (last: {why})")
        for p, samples in sorted(orphans.items()):
            w = min(live, key=lambda x: self.outstanding[x.index]).index
            # A sample carried in from the previous step restarts from its carried prefix (those
            # tokens came from older weights); from there, the same draws give the same tokens.
            pre = self.requests[p].prefixes
            self.new_item(p, sorted(samples), w, {s: pre[s] for s in samples if s in pre})
            co.pipe.rerun_samples += len(samples)

    def rebalance(self, h: WorkerHandle, rep: WorkerReport) -> None:
        """An idle worker takes waiting work from ``h``, or, in the tail, its most overdue sample."""
        co = self.co
        idle = [x for x in co.pool.alive() if x.started_at is None and self.outstanding[x.index] == 0
                and not self.pending[x.index]]
        if not self.plan.migrate or not idle:
            return
        target = idle[0]
        if rep.waiting:
            iid = rep.waiting[-1][0]
            p = self.item_prompt.get(iid)
            samples = [s for i, s in rep.waiting if i == iid]
            taken = [s for s in samples if h.call("abort", iid, s, timeout=co.worker_timeout_s) is not None]
            if taken and p is not None:
                self.outstanding[h.index] -= len(taken)
                self.new_item(p, taken, target.index)
                co.pipe.steals += len(taken)
            return
        if self.total - self.done_samples > co.tail_fraction * self.total or len(rep.running) < 2:
            return
        best, over = None, 0.0
        for iid, s, gen in rep.running:
            p = self.item_prompt.get(iid)
            late = gen - float(self.pred[p]) if p is not None else 0.0
            if late > over:
                best, over = (iid, p, s, gen), late
        if best is None:
            return
        iid, p, s, gen = best
        recompute = (len(self.requests[p].prompt_ids) + gen) * co.cost.prefill_per_token_s
        if (co.cost.step_s(len(rep.running)) - co.cost.step_s(1)) * gen <= recompute:
            return  # expecting as many tokens again, the move would not pay
        got = h.call("abort", iid, s, timeout=co.worker_timeout_s)
        if got is None:
            return
        self.outstanding[h.index] -= 1
        self.new_item(p, [s], target.index, {s: got})
        co.pipe.migrations += 1
