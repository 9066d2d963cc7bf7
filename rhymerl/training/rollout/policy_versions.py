"""Which policy version draws each step's batch, and which one the rollout workers hold.

Synchronous RL (staleness 0): step t's batch is drawn by the weights step t starts from, and
the workers get every update at once. Async RL (staleness S >= 1): step t's batch is drawn by
version ``max(0, t-1-S)`` and generated in a background thread while step t-1 trains; the
workers get a version only when a launch asks for it, so which version drew a batch is a
function of the step alone, never of timing. Versions older than the live weights that a
batch may still need are kept as copies (and travel in checkpoints).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from rhymerl.training.rollout.batch import ScoredRollout

Weights = dict[str, torch.Tensor]


class RolloutTimeout(RuntimeError):
    """The batch generating in the background did not finish within ``trainer.rollout_wait_s``."""


class InFlight:
    """A rollout running in a background thread (async RL), or done (restored from a checkpoint)."""

    def __init__(self, step: int, result: ScoredRollout | None = None) -> None:
        self.step, self.result = step, result
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self, fn: Callable[..., ScoredRollout], *args: Any) -> None:
        def body() -> None:
            try:
                self.result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised in the training thread by wait()
                self.error = e

        self.thread = threading.Thread(target=body, name=f"rhymerl-rollout-{self.step}", daemon=True)
        self.thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def wait(self) -> ScoredRollout:
        self.join()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


class PolicyVersions:
    """The one owner of policy-version bookkeeping: the live version, the workers' version,
    kept snapshots and the batch in flight.

    ``live`` returns the live weights (the policy's, an online draft head's too); ``send``
    loads weights into every rollout worker."""

    def __init__(self, staleness: int, live: Callable[[], Weights], send: Callable[[Weights], None], *,
                 wait_s: float = 3600.0) -> None:
        self.staleness, self.wait_s = staleness, wait_s
        self._live, self._send = live, send
        self.current = 0  # updates applied to the live weights
        self.workers = 0  # the version the rollout workers hold
        self.snapshots: dict[int, Weights] = {}  # older versions a batch may still be drawn by
        self.inflight: InFlight | None = None  # the next step's batch (async)

    @property
    def asynchronous(self) -> bool:
        return self.staleness > 0

    def version_for(self, step: int) -> int:
        """The policy version that draws step ``step``'s batch: a function of the step alone."""
        return max(0, step - 1 - self.staleness)

    def push(self, version: int) -> None:
        """The rollout workers to ``version`` (nothing to do if they hold it)."""
        if self.workers == version:
            return
        self._send(self._live() if version == self.current else self.snapshots[version])
        self.workers = version

    def resync(self) -> None:
        """Send the live weights whatever the workers were thought to hold (after a restore)."""
        self._send(self._live())
        self.workers = self.current

    def weights_of(self, version: int) -> Weights | None:
        """The weights of ``version`` if an older copy is kept (None: it is the live one)."""
        if version == self.current:
            return None
        if version not in self.snapshots:
            raise KeyError(f"policy version {version} is neither live ({self.current}) nor kept")
        return self.snapshots[version]

    def keep_current(self, step: int) -> None:
        """Before step ``step``'s update replaces the live weights: copy them if a later batch
        may still be drawn by them (step t+1's is drawn by version t-S), and drop copies no
        batch can need any more."""
        if self.staleness:
            oldest = step - self.staleness
            self.snapshots = {v: w for v, w in self.snapshots.items() if v >= oldest}
            if self.current >= oldest:
                self.snapshots[self.current] = {n: p.detach().clone() for n, p in self._live().items()}

    def updated(self, step: int) -> None:
        """Step ``step``'s update is in the live weights; synchronous workers get it now (async
        ones when a launch asks for a version)."""
        self.current = step
        if not self.staleness:
            self.push(self.current)

    def launch(self, step: int, rollout: Callable[..., ScoredRollout], *args: Any) -> None:
        """Start step ``step``'s rollout in the background, drawn by its version."""
        self.push(self.version_for(step))
        self.inflight = InFlight(step)
        self.inflight.start(rollout, *args)

    def take(self, step: int) -> ScoredRollout | None:
        """Step ``step``'s batch if it was launched (waiting for it, bounded), else None."""
        if self.inflight is None:
            return None
        if self.inflight.step != step:
            raise RuntimeError(f"the batch in flight is step {self.inflight.step}'s, not step {step}'s")
        self.settle()
        out, self.inflight = self.inflight.wait(), None
        return out

    def settle(self) -> None:
        """Let the batch in flight finish (its result is kept): before the workers are needed
        for something else (evaluation) or the state is saved. Bounded by ``wait_s``."""
        if self.inflight is not None:
            self.inflight.join(self.wait_s)
            if self.inflight.thread is not None and self.inflight.thread.is_alive():
                raise RolloutTimeout(f"the rollout of step {self.inflight.step} did not finish within "
                                     f"{self.wait_s:.0f}s (trainer.rollout_wait_s); the run stops, resume it with --resume")

    def close(self, timeout: float) -> None:
        """Never stop the workers under a running rollout: wait for it (bounded)."""
        if self.inflight is not None:
            self.inflight.join(timeout)

    # --- checkpoints -----------------------------------------------------------------------
    def inflight_state(self) -> dict[str, Any] | None:
        """The batch in flight, whole (a resumed run trains on exactly it); call after settle()."""
        return None if self.inflight is None else {"step": self.inflight.step, "rollout": self.inflight.wait().to_dict()}

    def save_snapshots(self, path: Any) -> None:
        if self.snapshots:
            torch.save({str(v): w for v, w in self.snapshots.items()}, path)

    def restore(self, step: int, snapshots: dict[int, Weights], inflight: InFlight | None) -> None:
        self.current = step
        self.snapshots = snapshots
        self.inflight = inflight
