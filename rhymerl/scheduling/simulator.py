"""A discrete-event simulation of one rollout step on R workers.

Each worker is a continuous-batching engine with ``max_num_seqs`` slots whose decode step
costs ``cost.step_s(B)`` at batch size B (and prefill ``cost.prefill_per_token_s`` per
token). Between two events (a sample finishes, samples are admitted, work moves) a worker's
batch is constant, so the simulation jumps from event to event: O(samples log samples).

Workers that share a machine's cores (local worker processes) slow each other down while
they are busy together and speed up as others go idle. All busy workers then run at the same
rate, so the events keep their order: the simulation runs in a worker's own time, and the
wall clock follows from how many were busy in each interval (processor sharing).
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from rhymerl.scheduling.cost import StepCost
from rhymerl.scheduling.plan import Plan

try:  # the compiled event loop, built by the package's install (setup.py)
    import rhymerl.scheduling._simulator_core as _core
except ImportError:  # pragma: no cover - a source tree without the build: the Python reference
    _core = None


@dataclass
class SimResult:
    policy: str
    workers: int
    makespan_s: float
    bubble_fraction: float  # idle worker-time / total worker-time within the rollout phase
    tokens: int
    migrations: int = 0  # running samples moved to another worker (KV recomputed there)
    steals: int = 0  # samples not yet started taken by an idle worker
    busy_s: list[float] = field(default_factory=list, repr=False)
    tail_share: float = 0.0  # share of the makespan after 90 % of the samples were done (own devices only)
    prompt_done_s: list[float] = field(default_factory=list, repr=False)  # when each prompt's last sample finished

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.makespan_s if self.makespan_s > 0 else 0.0


class _Worker:
    __slots__ = ("queue", "running", "due", "c", "t", "busy", "version", "done_at", "removed", "spans", "open_at")

    def __init__(self) -> None:
        self.queue: deque[int] = deque()  # samples not yet admitted, in submission order
        self.running: list[tuple[int, int]] = []  # heap (end counter, request id)
        self.due: list[tuple[float, int]] = []  # heap (start counter + predicted length, request id)
        self.c = 0  # decode steps done (every running sample advances one token per step)
        self.t = 0.0  # time at which ``c`` was reached
        self.busy = 0.0
        self.version = 0
        self.done_at = 0.0
        self.removed: set[int] = set()  # migrated away (lazy heap deletion)
        self.spans: list[tuple[float, float]] = []  # busy intervals (for shared cores)
        self.open_at: float | None = None  # start of the current busy interval

    def size(self) -> int:
        return len(self.running) - len(self.removed)


def simulate(plan: Plan, lengths: list[list[int]], prompt_lens: list[int] | int, cost: StepCost, *,
             max_num_seqs: int, predicted: np.ndarray | None = None, tail_fraction: float = 0.1,
             cores: float | None = None, threads: int = 1, contention: float = 1.0) -> SimResult:
    """Simulate ``plan`` when sample s of prompt p really produces ``lengths[p][s]`` tokens.

    ``cores``: the workers share this many cores, ``threads`` each, and ``cost`` is one
    worker's curve when it runs alone; while n of them are busy each runs
    ``max(1, n * threads / cores)`` times slower, and ``contention`` times slower again while
    more than one is busy (what workers cost each other beyond the cores they hold: memory
    bandwidth, caches, clocks; measured, ``rhymerl bench e2e``). None: every worker has its own
    device.

    With ``plan.migrate``, an idle worker first takes a not-yet-started sample from the
    worker with the most waiting; then, once at most ``tail_fraction`` of the samples are
    unfinished, the running sample furthest past its predicted length (``predicted[p]``) on
    a worker running at least two moves to it, if the time it should save (expecting as many
    tokens again as it has) exceeds the KV recompute.
    """
    R = len(plan.workers)
    P = len(lengths)
    plens = [prompt_lens] * P if isinstance(prompt_lens, int) else list(prompt_lens)
    pred = predicted if predicted is not None else plan.predicted
    if pred is None:
        pred = np.array([np.mean(x) for x in lengths])
    req_prompt: list[int] = []
    req_len: list[int] = []
    offsets = [0]
    for units in plan.workers:
        for u in units:
            row = lengths[u.prompt]
            for s in u.samples:
                req_prompt.append(u.prompt)
                req_len.append(max(1, int(row[s])))
        offsets.append(len(req_prompt))
    args = (np.asarray(offsets, dtype=np.int64), np.asarray(req_prompt, dtype=np.int64),
            np.asarray(req_len, dtype=np.int64), np.asarray(pred, dtype=np.float64),
            np.asarray(plens, dtype=np.int64))
    if _core is not None:
        out = _core.run_events(*args, np.asarray(cost.batch, dtype=np.float64),
                               np.asarray(cost.seconds, dtype=np.float64), float(cost.prefill_per_token_s),
                               max_num_seqs, bool(plan.migrate), float(tail_fraction))
    else:
        out = _events_reference(*args, cost, max_num_seqs, bool(plan.migrate), float(tail_fraction))
    finished_at = out["finished_at"]
    makespan = max(out["done_at"], default=0.0)
    busy = list(out["busy"])
    ninety_at = out["ninety_at"]
    if cores is not None:
        makespan, busy, to_wall = _shared_cores(out["spans"], cores, threads, contention)
        finished_at = to_wall(finished_at)
    prompt_done = np.zeros(P)
    np.maximum.at(prompt_done, args[1], np.asarray(finished_at, dtype=np.float64))
    bubble = 1.0 - sum(busy) / (R * makespan) if makespan > 0 else 0.0
    tail = 1.0 - ninety_at / makespan if cores is None and ninety_at is not None and makespan > 0 else 0.0
    return SimResult(plan.policy, R, makespan, bubble, int(sum(req_len)), out["migrations"], out["steals"], busy, tail,
                     prompt_done.tolist())


def _events_reference(offsets: np.ndarray, req_prompt_a: np.ndarray, req_len_a: np.ndarray, pred: np.ndarray,
                      plens_a: np.ndarray, cost: StepCost, max_num_seqs: int, migrate_on: bool,
                      tail_fraction: float) -> dict:
    """The event loop in Python: worker ``w`` runs requests ``offsets[w]:offsets[w+1]`` in
    that order. The compiled core (``_simulator_core.cpp``) is the same algorithm, operation for
    operation; the tests hold the two equal to the bit."""
    R = len(offsets) - 1
    req_prompt = req_prompt_a.tolist()
    req_len = req_len_a.tolist()
    plens = plens_a.tolist()
    pred = pred.tolist()
    ws = [_Worker() for _ in range(R)]
    for wi, w in enumerate(ws):
        w.queue.extend(range(int(offsets[wi]), int(offsets[wi + 1])))
    total = len(req_prompt)
    # Workers by how many samples wait in their queue (a lazy max-heap: an entry's count may be
    # stale, checked when it comes to the top): what an idle worker takes from first.
    by_queue = [(-len(w.queue), i) for i, w in enumerate(ws) if w.queue]
    heapq.heapify(by_queue)
    start = [0] * total  # worker counter at admission (shifted back by tokens made before a move)
    done = [False] * total
    finished_at = [0.0] * total
    unfinished = total
    ninety_at: float | None = None  # when 90 % of the samples were done
    waiting = total
    migrations = steals = 0
    step_s = cost.step_s
    pre = cost.prefill_per_token_s
    events: list[tuple[float, int, int]] = []  # (time, worker, version); version -1: an idle worker's wake-up
    waking: set[int] = set()
    # Per-worker arrays for the vectorised search of a migration candidate.
    A_c = np.zeros(R)
    A_t = np.zeros(R)
    A_B = np.zeros(R)
    A_due = np.full(R, np.inf)
    xb, yb = np.asarray(cost.batch, dtype=np.float64), np.asarray(cost.seconds, dtype=np.float64)

    def refresh(wi: int) -> None:
        w = ws[wi]
        while w.due and (done[w.due[0][1]] or w.due[0][1] in w.removed):
            heapq.heappop(w.due)
        A_c[wi], A_t[wi], A_B[wi] = w.c, w.t, w.size()
        A_due[wi] = w.due[0][0] if w.due else np.inf

    def admit(w: _Worker) -> None:
        nonlocal waiting
        free = max_num_seqs - w.size()
        seen: set[int] = set()
        prefill = 0
        while w.queue and free > 0:
            rid = w.queue.popleft()
            waiting -= 1
            p = req_prompt[rid]
            if p not in seen:  # samples of a prompt admitted together share one prefill
                seen.add(p)
                prefill += plens[p]
            start[rid] = w.c
            heapq.heappush(w.running, (w.c + req_len[rid], rid))
            heapq.heappush(w.due, (w.c + float(pred[p]), rid))
            free -= 1
        if prefill:
            w.t += prefill * pre
            w.busy += prefill * pre

    def schedule(wi: int) -> None:
        w = ws[wi]
        w.version += 1
        while w.running and w.running[0][1] in w.removed:
            w.removed.discard(heapq.heappop(w.running)[1])
        if w.running:
            heapq.heappush(events, (w.t + (w.running[0][0] - w.c) * step_s(w.size()), wi, w.version))
        else:
            w.done_at = w.t
            if w.open_at is not None:
                w.spans.append((w.open_at, w.t))
                w.open_at = None
        refresh(wi)

    def steal(wi: int, now: float) -> bool:
        nonlocal steals
        while by_queue:  # the longest queue, the first of equals
            n, victim = by_queue[0]
            now_n = len(ws[victim].queue)
            if now_n == -n:
                break
            if now_n:
                heapq.heapreplace(by_queue, (-now_n, victim))
            else:
                heapq.heappop(by_queue)
        else:
            return False
        thief = ws[wi]
        thief.queue.append(ws[victim].queue.pop())  # the shortest waiting work (queues run longest first)
        heapq.heappush(by_queue, (-len(thief.queue), wi))
        thief.t = max(thief.t, now)
        steals += 1
        return True

    def migrate(wi: int, now: float) -> bool:
        nonlocal migrations
        B = np.maximum(A_B, 1)
        steps_in_flight = (now - A_t) / np.interp(B, xb, yb)
        over = np.where((A_B >= 2) & (np.arange(R) != wi), A_c + steps_in_flight - A_due, -np.inf)
        j = int(np.argmax(over))
        if not over[j] > 0:
            # Nothing is overdue yet: wake up when the first candidate will be.
            eligible = (A_B >= 2) & (np.arange(R) != wi) & np.isfinite(A_due)
            if eligible.any() and wi not in waking:
                when = A_t + (A_due - A_c) * np.interp(B, xb, yb) + 1e-9
                t_wake = float(when[eligible].min())
                if t_wake > now:
                    waking.add(wi)
                    heapq.heappush(events, (t_wake, wi, -1))
            return False
        v = ws[j]
        Bv = v.size()
        d = min(int((now - v.t) / step_s(Bv)), v.running[0][0] - v.c)
        v.c += d
        v.t += d * step_s(Bv)
        v.busy += d * step_s(Bv)
        rid = heapq.heappop(v.due)[1]
        generated = v.c - start[rid]
        recompute = (plens[req_prompt[rid]] + generated) * pre
        if (step_s(Bv) - step_s(1)) * generated <= recompute:
            heapq.heappush(v.due, (np.inf, rid))  # not worth it: never reconsidered
            refresh(j)
            return False
        v.removed.add(rid)
        schedule(j)
        thief = ws[wi]
        thief.t = max(thief.t, now) + recompute
        thief.busy += recompute
        start[rid] = thief.c - generated
        heapq.heappush(thief.running, (thief.c + req_len[rid] - generated, rid))
        migrations += 1
        return True

    for wi, w in enumerate(ws):
        w.open_at = 0.0
        admit(w)
        schedule(wi)
    idle = [wi for wi, w in enumerate(ws) if not w.running]
    now = 0.0
    while True:
        if migrate_on and idle:
            still = []
            for k, wi in enumerate(idle):
                t_open = max(ws[wi].t, now)
                took = (waiting > 0 and steal(wi, now)) or (unfinished <= tail_fraction * total and migrate(wi, now))
                if took:
                    ws[wi].open_at = t_open
                    admit(ws[wi])
                    schedule(wi)
                elif waiting == 0:
                    # nothing to take now, and the candidates are the same for every idle worker
                    still += idle[k:]
                    break
                else:
                    still.append(wi)
            idle = still
        if not events:
            break
        t_ev, wi, ver = heapq.heappop(events)
        w = ws[wi]
        if ver == -1:
            waking.discard(wi)
            now = max(now, t_ev)
            continue
        if ver != w.version:
            continue
        now = t_ev
        w.busy += t_ev - w.t
        w.c = w.running[0][0]
        w.t = t_ev
        while w.running and w.running[0][0] <= w.c:
            _, rid = heapq.heappop(w.running)
            if rid in w.removed:
                w.removed.discard(rid)
                continue
            done[rid] = True
            finished_at[rid] = t_ev
            unfinished -= 1
            if ninety_at is None and unfinished <= 0.1 * total:
                ninety_at = t_ev
        admit(w)
        schedule(wi)
        if not w.running:
            idle.append(wi)
    return {"done_at": [w.done_at for w in ws], "busy": [w.busy for w in ws], "finished_at": finished_at,
            "spans": [w.spans for w in ws], "migrations": migrations, "steals": steals, "ninety_at": ninety_at}


def _shared_cores(spans: list[list[tuple[float, float]]], cores: float, threads: int, contention: float = 1.0):
    """Wall-clock makespan and busy time per worker from busy intervals in a worker's own time,
    when n busy workers each run ``max(1, n * threads / cores)`` times slower (and
    ``contention`` times more when n > 1); and the map from a worker's own time to the wall
    clock."""
    edges = sorted({x for ws in spans for sp in ws for x in sp})
    if not edges:
        return 0.0, [0.0] * len(spans), lambda ts: list(ts)
    delta: dict[float, int] = {}
    for ws in spans:
        for a, b in ws:
            if b > a:
                delta[a] = delta.get(a, 0) + 1
                delta[b] = delta.get(b, 0) - 1
    wall = {edges[0]: 0.0}
    n = 0
    for a, b in zip(edges, edges[1:]):
        n += delta.get(a, 0)
        wall[b] = wall[a] + (b - a) * max(1.0, n * threads / cores) * (contention if n > 1 else 1.0)
    xs, ys = np.array(edges), np.array([wall[e] for e in edges])
    return (wall[edges[-1]], [sum(wall[b] - wall[a] for a, b in ws) for ws in spans],
            lambda ts: np.interp(np.asarray(ts, dtype=np.float64), xs, ys).tolist())
