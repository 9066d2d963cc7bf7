"""Every call into a local vLLM engine bounded in time.

vLLM's in-process client waits on its engine-core process without a deadline (``step``, the
utility calls; ``collective_rpc``'s timeout is not applied there), so a hung or stopped engine
core would hold the run forever. A :class:`Watchdog` thread watches one call at a time: past
its deadline it kills the engine's processes (the engine core and its workers) and wakes the
blocked call (vLLM's sync client would wait on a dead engine too), which then raises
:class:`EngineTimeout` naming the engine and the call.
The hot path pays two attribute writes per call; the thread wakes a few times a second.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Callable, Iterator


class EngineTimeout(RuntimeError):
    """A call into a vLLM engine did not return within its bound; the engine was closed."""


class EngineLost(RuntimeError):
    """A vLLM engine's processes ended under a call (killed, crashed, out of memory)."""


class Watchdog:
    def __init__(self, pids: Callable[[], list[int]], timeout_s: float, name: str = "vLLM engine",
                 wake: Callable[[Exception], None] = lambda e: None) -> None:
        self.pids, self.timeout_s, self.name, self.wake = pids, timeout_s, name, wake
        self._deadline: float | None = None
        self._what = ""
        self._fired: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"rhymerl-watchdog-{name}", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def call(self, what: str) -> Iterator[None]:
        if self._fired:
            raise EngineTimeout(self._fired)
        self._what, self._deadline = what, time.monotonic() + self.timeout_s
        try:
            yield
        except Exception as e:  # noqa: BLE001 - a call ended by the kill says why it ended
            if self._fired:
                raise EngineTimeout(self._fired) from e
            if type(e).__name__ == "EngineDeadError":  # vLLM's word for an engine core that ended
                raise EngineLost(f"{self.name}: its engine core ended during {what} (killed, crashed or out of "
                                 "memory; its log above says which). `rhymerl train --resume RUN` continues from "
                                 "the last checkpoint") from e
            raise
        finally:
            self._deadline = None
        if self._fired:
            raise EngineTimeout(self._fired)

    def _watch(self) -> None:
        period = min(0.5, max(0.05, self.timeout_s / 8))
        while not self._stop.wait(period):
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline and not self._fired:
                pids = self.pids()
                self._fired = (f"{self.name} (pids {pids}): {self._what} did not return within {self.timeout_s:.0f}s "
                               "(rollout.worker_timeout_s); the engine was closed. `rhymerl train --resume RUN` "
                               "continues from the last checkpoint")
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                self.wake(EngineTimeout(self._fired))

    def close(self) -> None:
        self._stop.set()


def process_tree(pids: list[int]) -> list[int]:
    """``pids`` and all their descendants (vLLM's engine core starts its workers)."""
    import psutil

    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            out += [pid] + [c.pid for c in p.children(recursive=True)]
    return out
