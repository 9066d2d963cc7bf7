"""Reward functions in a small pool of processes, each call bounded in time.

A user's reward function (or math-verify on an adversarial answer) can loop forever or
crash its process; neither may hang or kill a training run. The controller sends calls to
worker processes in chunks and waits for the answers one by one: a call that has not
answered ``timeout_s`` after the previous answer of its worker (or the chunk's start) has
its worker killed and replaced, scores 0 and is reported as timed out; a worker that dies
mid-call scores that call 0 as an error. The rest of the chunk goes on in the new worker.

Calls run in the worker's main thread, so math-verify's own ``signal.alarm`` timeouts are on
there as well.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from rhymerl.rewards.registry import RewardCall, RewardResult, RewardSpec

log = logging.getLogger(__name__)



class RewardLoadError(RuntimeError):
    """The reward functions (a user's reward file) could not be loaded; the message says why."""

def _serve(conn: Connection, spec: RewardSpec) -> None:
    """A pool worker: build the registry, then answer chunks of calls, one message per call."""
    try:
        registry = spec.build()
    except Exception as e:  # noqa: BLE001 - reported to the controller, which raises it
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        for i, call in msg:
            conn.send((i, registry.score_many([call])[0]))


class _Worker:
    def __init__(self, ctx: Any, spec: RewardSpec) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, spec), daemon=True, name="rhymerl-reward")
        self.proc.start()
        child.close()
        kind, detail = self.conn.recv() if self.conn.poll(120) else ("init_error", "did not start within 120 s")
        if kind != "ready":
            self.kill()
            raise RewardLoadError(f"reward worker could not load the reward functions: {detail}")
        self.queue: list[tuple[int, RewardCall]] = []  # sent, not yet answered, in order
        self.deadline = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class RewardPool:
    """``score_many`` like :class:`RewardRegistry`, in ``workers`` processes with a per-call timeout."""

    def __init__(self, spec: RewardSpec, *, workers: int = 1, timeout_s: float = 10.0) -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"reward pool: workers must be >= 1 and timeout_s > 0 (got {workers}, {timeout_s})")
        self.spec, self.timeout_s = spec, timeout_s
        # spawn, not fork: the controller holds torch threads and open pipes a fork would copy
        self._ctx = mp.get_context("spawn")
        self._workers = [_Worker(self._ctx, spec) for _ in range(workers)]
        self.timeouts = 0  # calls that ran past timeout_s, over the pool's life
        self.crashes = 0  # calls whose worker process died

    def score_many(self, calls: list[RewardCall]) -> list[RewardResult]:
        results: list[RewardResult | None] = [None] * len(calls)
        if not calls:
            return []
        n = len(self._workers)
        chunks = [[(i, calls[i]) for i in range(w, len(calls), n)] for w in range(n)]
        for w, chunk in zip(self._workers, chunks):
            self._send(w, chunk)
        while any(w.queue for w in self._workers):
            busy = [w for w in self._workers if w.queue]
            ready = wait([w.conn for w in busy], timeout=max(0.0, min(w.deadline for w in busy) - time.monotonic()))
            for w in busy:
                if w.conn in ready:
                    try:
                        i, res = w.conn.recv()
                    except (EOFError, OSError):
                        self._replace(w, "its process died", timed_out=False, results=results)
                        continue
                    results[i] = res
                    w.queue.pop(0)
                    w.deadline = time.monotonic() + self.timeout_s
                elif time.monotonic() >= w.deadline:
                    self._replace(w, f"timed out after {self.timeout_s:g} s (reward.timeout_s)", timed_out=True,
                                  results=results)
        return [r for r in results if r is not None]

    def _send(self, w: _Worker, chunk: list[tuple[int, RewardCall]]) -> None:
        w.queue = list(chunk)
        w.deadline = time.monotonic() + self.timeout_s
        if chunk:
            w.conn.send(chunk)

    def _replace(self, w: _Worker, why: str, *, timed_out: bool, results: list[RewardResult | None]) -> None:
        """The call at the head of ``w``'s queue failed: score it 0, restart the worker, resend the rest."""
        i, call = w.queue.pop(0)
        if timed_out:
            self.timeouts += 1
        else:
            self.crashes += 1
        results[i] = RewardResult(0.0, error=f"{call.where or call.data_source}: reward function "
                                             f"for {call.data_source!r} {why}", timed_out=timed_out)
        rest = w.queue
        w.kill()
        fresh = _Worker(self._ctx, self.spec)
        self._workers[self._workers.index(w)] = fresh
        self._send(fresh, rest)

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
            w.proc.join(2)
            w.kill()
        self._workers = []

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
