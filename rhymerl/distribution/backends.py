"""Where rollout workers live: in this process, in local processes, or in Ray actors.

Every backend gives the same :class:`WorkerHandle`: start one call, learn when it is done,
take its result (or :class:`WorkerLost`), kill. The coordinator keeps at most one call in
flight per worker. Weights travel by shared memory (local) or the object store (Ray),
never through files.
"""
from __future__ import annotations

import logging
import os
import time
import traceback
from multiprocessing.connection import wait as mp_wait
from typing import Any, Mapping

import torch

from rhymerl.device import torch_threads
from rhymerl.distribution.work import WorkerLost, WorkerSpec
from rhymerl.distribution.worker import RolloutWorker
from rhymerl.rollout_engines import BACKENDS, get_engine

log = logging.getLogger(__name__)


class WorkerHandle:
    index: int
    alive: bool = True
    started_at: float | None = None  # when the call in flight began

    def start(self, method: str, *args: Any) -> None:
        raise NotImplementedError

    def result(self) -> Any:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """A blocking call; a worker silent for ``timeout`` seconds is killed (:class:`WorkerLost`)."""
        self.start(method, *args)
        if timeout is not None and not self.wait_result(timeout):
            self.kill()
            raise WorkerLost(f"worker {self.index} lost: no answer to {method!r} in {timeout:.0f}s")
        return self.result()

    def wait_result(self, timeout: float) -> bool:
        """Whether the call in flight answers (or the worker dies) within ``timeout`` seconds."""
        return True


def call_all(handles: list[WorkerHandle], method: str, *args: Any, timeout: float) -> list[Any]:
    """Start ``method`` on every handle, then wait for each, ``timeout`` seconds at most in all:
    a worker that does not answer is killed and named (:class:`WorkerLost`)."""
    for h in handles:
        h.start(method, *args)
    deadline = time.monotonic() + timeout
    out = []
    for h in handles:
        if not h.wait_result(max(0.0, deadline - time.monotonic())):
            h.kill()
            raise WorkerLost(f"worker {h.index} lost: no answer to {method!r} in {timeout:.0f}s "
                             "(rollout.worker_timeout_s); the run stops, resume it with --resume")
        out.append(h.result())
    return out


class WorkerPool:
    """R workers of one backend; every blocking call to them is bounded by ``timeout_s``."""

    handles: list[WorkerHandle]
    timeout_s: float = 300.0

    def wait(self, timeout: float) -> list[WorkerHandle]:
        """Handles whose call has finished (or whose worker died), waiting up to ``timeout``."""
        raise NotImplementedError

    def update_weights(self, named: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def alive(self) -> list[WorkerHandle]:
        return [h for h in self.handles if h.alive]

    def gate_states(self, timeout: float | None = None) -> list[dict[str, Any] | None]:
        """Each worker's speculation-gate state (None: dead, or no gate), for checkpoints."""
        timeout = self.timeout_s if timeout is None else timeout
        return [h.call("gate_state", timeout=timeout) if h.alive else None for h in self.handles]

    def load_gate_states(self, states: list[dict[str, Any] | None], timeout: float | None = None) -> None:
        """Restore what :meth:`gate_states` saved, worker by worker (extra or missing entries are skipped)."""
        timeout = self.timeout_s if timeout is None else timeout
        for h, st in zip(self.handles, states):
            if h.alive and st is not None:
                h.call("load_gate_state", st, timeout=timeout)

    def close(self) -> None:
        for h in self.handles:
            if h.alive:
                h.kill()


# --- in this process --------------------------------------------------------------------------
class InprocHandle(WorkerHandle):
    """The worker runs in the caller's thread; a call completes when started."""

    def __init__(self, index: int, spec: WorkerSpec) -> None:
        # The worker's thread count applies while it runs, the caller's (training) otherwise.
        self.threads = spec.threads
        with torch_threads(self.threads):
            cls = get_engine(spec.engine).worker_class()
            self.index, self.worker = index, cls(WorkerSpec(**{**vars(spec), "threads": 0}))
        self._result: Any = None
        self._error: BaseException | None = None

    def start(self, method: str, *args: Any) -> None:
        self.started_at = time.monotonic()
        try:
            with torch_threads(self.threads):
                self._result, self._error = getattr(self.worker, method)(*args), None
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self._result, self._error = None, e

    def result(self) -> Any:
        self.started_at = None
        if self._error is not None:
            raise self._error
        return self._result

    def kill(self) -> None:
        self.alive = False
        close = getattr(self.worker, "close", None)  # a vLLM worker's engine core is a process of its own
        if close is not None:
            close()


class InprocPool(WorkerPool):
    def __init__(self, specs: list[WorkerSpec]) -> None:
        self.handles = [InprocHandle(i, s) for i, s in enumerate(specs)]

    def wait(self, timeout: float) -> list[WorkerHandle]:
        return [h for h in self.handles if h.alive and h.started_at is not None]

    def update_weights(self, named: Mapping[str, torch.Tensor]) -> None:
        for h in self.alive():
            h.worker.update_weights(named)


# --- local processes ----------------------------------------------------------------------------
def _serve(conn, cls: type, args: tuple) -> None:
    """A worker process: build ``cls(*args)``, then answer calls until told to stop or the pipe closes."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints where a hung worker is
    try:
        obj = cls(*args)
    except BaseException:  # noqa: BLE001 - reported to the controller
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", os.getpid()))
    while True:
        try:
            method, call_args = conn.recv()
        except (EOFError, OSError):
            return
        if method == "close":
            return
        try:
            conn.send(("ok", getattr(obj, method)(*call_args)))
        except BaseException:  # noqa: BLE001 - one failing call does not take the worker down
            conn.send(("error", traceback.format_exc()))


class SharedWeightsWorker(RolloutWorker):
    """A rollout worker that reads its weight syncs from a buffer shared with the controller."""

    def __init__(self, spec: WorkerSpec, flat: torch.Tensor, layout: list[tuple[str, int, tuple[int, ...]]]) -> None:
        super().__init__(spec)
        self._flat, self._layout = flat, layout

    def load_shared(self) -> None:
        self.update_weights({n: self._flat[o:o + _numel(s)].view(s) for n, o, s in self._layout})


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class ProcessHandle(WorkerHandle):
    def __init__(self, index: int, proc, conn) -> None:
        self.index, self.proc, self.conn = index, proc, conn

    def start(self, method: str, *args: Any) -> None:
        if not self.alive:
            raise WorkerLost(f"worker {self.index} is gone")
        self.started_at = time.monotonic()
        try:
            self.conn.send((method, args))
        except (BrokenPipeError, OSError) as e:
            self._lost(f"pipe closed ({e})")

    def result(self) -> Any:
        self.started_at = None
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError, ConnectionResetError):
            self._lost(f"process exited (code {self.proc.exitcode})" if not self.proc.is_alive()
                       else "pipe closed")
        if status == "error":
            raise RuntimeError(f"worker {self.index}: {value}")
        return value

    def _lost(self, why: str) -> None:
        self.kill()
        raise WorkerLost(f"worker {self.index} lost: {why}")

    def wait_result(self, timeout: float) -> bool:
        return bool(mp_wait([self.conn, self.proc.sentinel], timeout=timeout))

    def kill(self) -> None:
        self.alive = False
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)


def shared_buffer(named: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, list[tuple[str, int, tuple[int, ...]]]]:
    """One float32 shared-memory buffer with room for every tensor of ``named``, and its layout."""
    layout, off = [], 0
    for n, t in named.items():
        layout.append((n, off, tuple(t.shape)))
        off += t.numel()
    return torch.empty(off, dtype=torch.float32).share_memory_(), layout


# What the process server imports once, so that each process forked from it starts with them
# loaded instead of importing torch and this package again (2.5-4 s of CPU per process here).
_SERVER_PRELOAD = ["torch", "rhymerl.distribution.worker", "rhymerl.training.update.rank"]


def spawn_processes(cls: type, args: list[tuple], *, name: str, preload: tuple[str, ...] = (),
                    timeout: float = 300.0) -> list[ProcessHandle]:
    """One process per ``args`` entry, each serving ``cls(*entry)``; returns once all are built
    (a failed build raises, naming the process; one not built within ``timeout`` seconds too).

    Processes come from a fork server (``multiprocessing``'s ``forkserver``): a clean process,
    started once, that has imported torch but never run an op, so a child inherits no torch
    threads and no state of the caller's (as with ``spawn``) and starts without importing them
    again (a 2-rank training run's start: 6.1 -> 5.2 s here). ``preload``: more modules for the
    server to import, if this call starts it (it starts once per process)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_SERVER_PRELOAD + list(preload))
    handles = []
    for i, a in enumerate(args):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, cls, a), daemon=True, name=f"{name}-{i}")
        proc.start()
        child.close()
        handles.append(ProcessHandle(i, proc, parent))
    try:
        deadline = time.monotonic() + timeout
        for h in handles:  # each process says it is ready once built
            h.started_at = time.monotonic()
            if not h.wait_result(max(0.0, deadline - time.monotonic())):
                raise WorkerLost(f"{name}-{h.index}: not built within {timeout:.0f}s")
            h.result()
    except BaseException:
        for h in handles:
            h.kill()
        raise
    return handles


class ProcessPool(WorkerPool):
    """Worker processes on this machine (from a fork server: no inherited torch threads), the cores
    split among them."""

    def __init__(self, specs: list[WorkerSpec], named: Mapping[str, torch.Tensor], *, timeout_s: float = 300.0) -> None:
        # One flat shared buffer holds every weight; a sync writes it once and each worker
        # copies from it, so the weights never pass through a pipe or a file.
        self.timeout_s = timeout_s
        self._flat, self._layout = shared_buffer(named)
        self.handles = spawn_processes(SharedWeightsWorker, [(spec, self._flat, self._layout) for spec in specs],
                                       name="rhymerl-worker", timeout=timeout_s)

    def wait(self, timeout: float) -> list[WorkerHandle]:
        busy = {h.conn: h for h in self.handles if h.alive and h.started_at is not None}
        sentinels = {h.proc.sentinel: h for h in busy.values()}
        ready = mp_wait(list(busy) + list(sentinels), timeout=timeout)
        out = []
        for r in ready:
            h = busy.get(r) or sentinels.get(r)
            if h is not None and h not in out:
                out.append(h)
        return out

    def update_weights(self, named: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, o, s in self._layout:
                self._flat[o:o + _numel(s)].copy_(named[n].detach().reshape(-1).to("cpu", torch.float32))
        call_all(self.alive(), "load_shared", timeout=self.timeout_s)

    def close(self) -> None:
        for h in self.alive():
            try:
                h.conn.send(("close", ()))
            except (BrokenPipeError, OSError):
                pass
            h.proc.join(timeout=5)
            h.kill()


# --- Ray -----------------------------------------------------------------------------------------
class RayHandle(WorkerHandle):
    def __init__(self, index: int, actor) -> None:
        self.index, self.actor = index, actor
        self.ref = None

    def start(self, method: str, *args: Any) -> None:
        if not self.alive:
            raise WorkerLost(f"worker {self.index} is gone")
        self.started_at = time.monotonic()
        self.ref = getattr(self.actor, method).remote(*args)

    def result(self) -> Any:
        import ray

        self.started_at = None
        ref, self.ref = self.ref, None
        try:
            return ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as e:
            self.kill()
            raise WorkerLost(f"worker {self.index} lost: {type(e).__name__}") from None
        except ray.exceptions.RayTaskError as e:
            raise RuntimeError(f"worker {self.index}: {e}") from None

    def wait_result(self, timeout: float) -> bool:
        import ray

        return bool(ray.wait([self.ref], timeout=timeout)[0])

    def kill(self) -> None:
        import ray

        self.alive = False
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass


def ping_actors(handles: list[RayHandle], timeout: float, what: str) -> None:
    """Wait for new actors to be placed and built, ``timeout`` seconds at most: an actor asking
    for a resource the cluster lacks (a GPU) waits forever otherwise. Stragglers are killed."""
    import ray

    refs = [h.actor.ping.remote() for h in handles]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    if len(ready) < len(refs):
        late = [h.index for h, r in zip(handles, refs) if r not in ready]
        for h in handles:
            h.kill()
        raise WorkerLost(f"{what} {late} not started within {timeout:.0f}s (does the cluster have the CPUs and "
                         "GPUs they ask for? `ray status` shows pending demands)")
    ray.get(ready)


class InsecureClusterError(RuntimeError):
    """Ray's token authentication is off and the config did not allow that."""


def init_ray(address: str | None = None, *, num_cpus: int | None = None, threads: int = 1,
             allow_insecure: bool = False) -> None:
    """Start a local Ray cluster (``address=None``) or join one, unless Ray is already up.

    Ray's token authentication stays as Ray sets it, and no process-wide environment is
    changed here: a local cluster gets a token that ``ray.init`` generates under ``~/.ray/``
    (on by default since Ray 2.59); joining a cluster sends that cluster's token, found by Ray
    when ``RAY_AUTH_MODE=token`` is set with ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or
    ``~/.ray/auth_token`` (see the README). Ray 2.60's servers listen on every interface
    whatever node address is given (measured with ``ss -ltnp``): the token is the protection,
    so starting or joining with it off is refused unless ``allow_insecure`` (logged).
    """
    import ray

    disabled = os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled"

    def refuse_or_warn() -> None:
        why = (f"Ray token authentication is off (RAY_AUTH_MODE={os.environ.get('RAY_AUTH_MODE', '')!r}): anyone "
               "who reaches the cluster's ports can run code on it")
        if not allow_insecure:
            raise InsecureClusterError(f"{why}; turn it on (unset RAY_AUTH_MODE or set it to 'token'), or set "
                                       "cluster.allow_insecure=true to run anyway")
        log.warning("%s; running anyway (cluster.allow_insecure=true)", why)

    started = False
    if not ray.is_initialized():  # Ray started before the run (by the user's program) is checked too
        if disabled:
            refuse_or_warn()  # before a local cluster opens its ports
        if address:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}})
        started = True
    if not ray_authenticated():  # off some other way (Ray's own config): known only once connected
        try:
            refuse_or_warn()
        except InsecureClusterError:
            if started:
                ray.shutdown()
            raise


def ray_authenticated() -> bool:
    """Whether the connected Ray cluster authenticates its clients: any mode but disabled (token,
    or the Kubernetes token mode of newer Ray versions)."""
    from ray._raylet import AuthenticationMode, get_authentication_mode

    return get_authentication_mode() != AuthenticationMode.DISABLED


class RayPool(WorkerPool):
    """Each worker a Ray actor. ``address=None`` starts a local cluster; else joins that one
    (authenticated: see :func:`init_ray`)."""

    def __init__(self, specs: list[WorkerSpec], *, address: str | None = None, num_cpus: int | None = None,
                 timeout_s: float = 300.0, allow_insecure: bool = False) -> None:
        import ray

        self.timeout_s = timeout_s
        init_ray(address, num_cpus=num_cpus or max(len(specs), os.cpu_count() or 1), threads=specs[0].threads,
                 allow_insecure=allow_insecure)
        actor_cls = ray.remote(num_cpus=1)(get_engine(specs[0].engine).worker_class())
        self.handles = [RayHandle(i, actor_cls.remote(spec)) for i, spec in enumerate(specs)]
        ping_actors(self.handles, timeout_s, "rollout worker")

    def wait(self, timeout: float) -> list[WorkerHandle]:
        import ray

        busy = {h.ref: h for h in self.handles if h.alive and h.ref is not None}
        if not busy:
            return []
        ready, _ = ray.wait(list(busy), num_returns=1, timeout=timeout)
        if ready:  # take every other finished call too
            more, _ = ray.wait(list(busy), num_returns=len(busy), timeout=0)
            ready = list({*ready, *more})
        return [busy[r] for r in ready]

    def update_weights(self, named: Mapping[str, torch.Tensor]) -> None:
        import ray

        # numpy arrays go through the object store without pickling the data (zero-copy reads)
        ref = ray.put({n: t.detach().to("cpu", torch.float32).numpy() for n, t in named.items()})
        call_all(self.alive(), "update_weights_numpy", ref, timeout=self.timeout_s)

    def close(self) -> None:
        for h in self.alive():
            h.kill()


def make_pool(backend: str, specs: list[WorkerSpec], named: Mapping[str, torch.Tensor], *,
              address: str | None = None, in_process: bool = True, timeout_s: float = 300.0,
              allow_insecure: bool = False) -> WorkerPool:
    """``local``: in this process for one worker (``in_process``), else spawned processes;
    ``ray``: Ray actors. ``timeout_s`` bounds every blocking call to a worker."""
    if backend == "local":
        # A vLLM worker is a client: its engine core already runs in a process of its own.
        inproc = (len(specs) == 1 and in_process) or get_engine(specs[0].engine).own_processes
        pool: WorkerPool = InprocPool(specs) if inproc else ProcessPool(specs, named, timeout_s=timeout_s)
    elif backend == "ray":
        pool = RayPool(specs, address=address, timeout_s=timeout_s, allow_insecure=allow_insecure)
    else:
        raise ValueError(f"rollout.backend {backend!r} is not one of {list(BACKENDS)}")
    pool.update_weights(named)
    return pool
