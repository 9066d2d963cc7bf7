"""The vLLM path's audit findings (issue 56), each as a test that failed on the code before it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from rhymerl.vllm import lifetime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A trainer that is pid 1 (a container without an init) starts a child that registers, as vLLM's
# engine core does; the child must live.
_TRAINER = textwrap.dedent("""
    import os, subprocess, sys
    env = dict(os.environ, RHYMERL_VLLM_OWNER=str(os.getpid()))
    child = "from rhymerl.vllm.lifetime import register; register(); print('alive', flush=True)"
    r = subprocess.run([sys.executable, "-c", child], env=env)
    print("pid", os.getpid(), "child rc", r.returncode, flush=True)
    sys.exit(r.returncode)
""")


def _can_unshare() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-pf", "--mount-proc", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_an_engine_process_started_by_a_trainer_that_is_pid_1_lives():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if _can_unshare():  # the trainer really is pid 1 of its namespace
        cmd = ["unshare", "-pf", "--mount-proc", sys.executable, "-c", _TRAINER]
    else:  # no PID namespace here: the same child, its owner and parent pid read as 1
        pytest.skip("no PID namespace on this machine (test_the_owner_is_compared_not_pid_1 covers the rule)")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert "pid 1 " in r.stdout, r.stdout + r.stderr
    assert r.returncode == 0 and "alive" in r.stdout, f"the child killed itself: {r.stdout} {r.stderr}"


def test_the_owner_is_compared_not_pid_1(monkeypatch):
    """The rule alone, with pids injected: a parent of pid 1 that is the owner is alive; a parent
    that changed during registration, or an owner gone, ends the process."""
    killed = []
    monkeypatch.setattr(lifetime.os, "getpid", lambda: 4242)
    monkeypatch.setattr(lifetime.os, "kill", lambda pid, sig: killed.append((pid, sig)) if sig else None)
    monkeypatch.setenv(lifetime.OWNER, "1")
    monkeypatch.setattr(lifetime.os, "getppid", lambda: 1)
    lifetime.register()
    assert killed == []
    parents = iter([1234, 1])  # reparented to init between the read and the request
    monkeypatch.setattr(lifetime.os, "getppid", lambda: next(parents))
    monkeypatch.setenv(lifetime.OWNER, "1234")
    lifetime.register()
    assert killed and killed[-1][0] == 4242


def test_a_child_whose_owner_has_already_ended_ends(monkeypatch):
    killed = []

    def kill(pid, sig):
        if sig == 0:
            raise ProcessLookupError
        killed.append(pid)

    monkeypatch.setattr(lifetime.os, "getpid", lambda: 4242)
    monkeypatch.setattr(lifetime.os, "getppid", lambda: 1)  # already reparented before it looked
    monkeypatch.setattr(lifetime.os, "kill", kill)
    monkeypatch.setenv(lifetime.OWNER, "999999")
    lifetime.register()
    assert killed == [4242]
