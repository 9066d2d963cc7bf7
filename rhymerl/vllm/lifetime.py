"""vLLM's processes end with the rhymerl process that started them.

vLLM's engine core and its workers are processes of their own; when the trainer that started
them is killed (kill -9, an OOM kill) they stay behind, holding their memory and cores while the
resumed run starts new ones beside them. :func:`register`, a ``vllm.general_plugins`` entry point, runs in every
vLLM process; in one started under a rhymerl engine (``RHYMERL_VLLM_OWNER``, the starting
process's pid, set by :class:`rhymerl.vllm.engine.VllmEngine`) it asks Linux to kill it when its
parent ends (``PR_SET_PDEATHSIG``): the engine core with the trainer, the workers with the core.
Other vLLM programs are left alone.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

OWNER = "RHYMERL_VLLM_OWNER"
_PR_SET_PDEATHSIG = 1


def register() -> None:
    owner = os.environ.get(OWNER)
    if not owner or not sys.platform.startswith("linux") or str(os.getpid()) == owner:
        return
    parent = os.getppid()  # before the request: a change after it means the parent ended in between
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    # Never "parent is pid 1": in a container without an init the trainer itself is pid 1.
    if os.getppid() != parent or not _alive(int(owner)):
        os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (the owner ended before this process started)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
