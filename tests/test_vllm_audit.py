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


def _siblings_of(prop):
    sib = next(s for s in prop.controller.sources if s.name == "siblings")
    return {k: sorted(v.members) for k, v in sib._live.items()}


@pytest.mark.parametrize("named", [False, True])
def test_siblings_of_requests_that_name_no_sample_are_all_indexed(named):
    """Four requests of one prompt (vLLM's n=4 children, or four generate calls) with no
    extra_args: each is its own member of the sibling index, not all sample 0."""
    from types import SimpleNamespace

    import numpy as np

    from tests.test_vllm_proposer import MAX_LEN, Runner, proposer

    runner = Runner()
    prop = proposer(runner)
    prompt = [5, 6, 7, 8]
    rids = [f"{i}_req-17" for i in range(4)]  # vLLM's child ids of an n=4 parent
    for i, rid in enumerate(rids):
        extra = {"sample": i, "group_size": 4} if named else None
        runner.requests[rid] = SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra, max_tokens=8,
                                                                               temperature=1.0))
    runner.input_batch.req_ids = rids
    runner.input_batch.num_prompt_tokens = np.full(4, len(prompt), dtype=np.int64)
    rows = np.zeros((4, MAX_LEN), dtype=np.int64)
    rows[:, : len(prompt)] = prompt
    rows[:, len(prompt)] = [9, 10, 11, 12]
    prop.propose([[9], [10], [11], [12]], np.full(4, len(prompt) + 1), rows)
    assert list(_siblings_of(prop).values()) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("override, words", [
    ("trainer.output_dir=runs/{model}", "trainer.output_dir: 'runs/{model}' has a placeholder it cannot fill"),
    ("sft.output_dir=ckpt/{engine}", "sft.output_dir: 'ckpt/{engine}' has a placeholder"),
])
def test_an_output_folder_with_an_unknown_placeholder_is_one_line(override, words):
    from rhymerl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=words.replace("{", r"\{").replace("}", r"\}")):
        load_config(None, [override])


def test_the_vllm_engine_without_vllm_is_refused_before_anything_runs(monkeypatch):
    import importlib.util

    from rhymerl.config import ConfigError, load_config

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find(name, *a))
    with pytest.raises(ConfigError, match=r"rollout.engine=vllm: vllm is not installed here \(pip install"):
        load_config(None, ["rollout.engine=vllm"])


@pytest.mark.parametrize("settings, words", [
    ({"historydir": "/tmp/x"}, r"unknown keys \['historydir'\]"),
    ({"recrod": False}, r"unknown keys \['recrod'\]"),
    ({"history_tokens": "lots"}, r'\["rhymerl"\]\.history_tokens: expected int, got .lots.'),
    ({"speculative": {"gate": "false"}}, r"speculative\.gate: expected bool, got 'false'"),
    ({"history": "/nonexistent/history.json.gz"}, r"\['history'\]: /nonexistent/history.json.gz: no such file"),
])
def test_a_mistake_in_the_proposers_settings_is_refused_by_name(settings, words):
    from tests.test_vllm_proposer import Runner, proposer

    with pytest.raises(ValueError, match=words):
        proposer(Runner(), **settings)


def test_a_shared_history_folder_that_cannot_be_made_costs_sharing_not_the_engine(tmp_path):
    from tests.test_vllm_proposer import Runner, proposer

    blocker = tmp_path / "file"
    blocker.write_text("")
    p = proposer(Runner(), history_dir=str(blocker / "sub"))  # a folder under a file: mkdir fails
    assert p.shared is None and p.recorder is not None


def test_the_proposer_settings_table_in_the_docs_is_generated_from_the_type():
    from pathlib import Path

    from rhymerl.config_reference import proposer_settings_table

    doc = (Path(ROOT) / "docs" / "integrations.md").read_text()
    assert proposer_settings_table() in doc, "docs/integrations.md's settings table is stale"


def test_a_forced_v2_model_runner_is_refused_naming_the_version():
    pytest.importorskip("vllm")
    from rhymerl.vllm.engine import VllmUnavailable, check_runner

    check_runner({"method": "custom_class"}, env={})  # the V1 runner: runs
    check_runner({"method": "eagle3"}, env={"VLLM_USE_V2_MODEL_RUNNER": "1"})  # V2 runs eagle3
    with pytest.raises(VllmUnavailable, match=r"vLLM 0\.\d+.*VLLM_USE_V2_MODEL_RUNNER=1 .* no 'custom_class' proposer"):
        check_runner({"method": "custom_class"}, env={"VLLM_USE_V2_MODEL_RUNNER": "1"})


def test_two_engines_halves_of_a_group_merge_through_the_shared_folder(tmp_path):
    """history_epochs=1: engines A and B each serve half of a prompt's group; after they read each
    other's segment each holds the whole group, not only the other's half; a late segment of an
    older epoch does not displace the newer one."""
    from rhymerl.drafting import HistoryStore
    from rhymerl.vllm.shared_history import SharedHistory

    stores = [HistoryStore(max_rollouts=1), HistoryStore(max_rollouts=1)]
    shares = [SharedHistory(tmp_path, s, vocab_size=50, interval_s=0) for s in stores]
    prompt = [1, 2, 3]
    for i, (store, share) in enumerate(zip(stores, shares)):
        half = [[10 + i, 11], [20 + i, 21]]
        store.add("p", prompt, half, 1)
        share.record("p", prompt, half, 1)
    for share in shares:
        share.tick(now=1.0)
        share.flush()
    for share in shares:
        share.tick(now=2.0)
        share.flush()
    for store in stores:
        (r,) = store.prompts["p"].rollouts
        assert r.step == 1 and sorted(x[0] for x in r.responses) == [10, 11, 20, 21]
    stores[0].add("p", prompt, [[30, 31]], 2)
    stores[0].add("p", prompt, [[40, 41]], 1)  # late: epoch 1 after epoch 2 is kept
    (r,) = stores[0].prompts["p"].rollouts
    assert r.step == 2 and r.responses == [[30, 31]]


def test_the_drafting_step_never_waits_for_a_slow_folder_and_a_foreign_tokenizer_is_refused(tmp_path, monkeypatch):
    """A read taking 0.5 s leaves tick() at once (the drafts go on with the history there is);
    the next tick takes it in. A segment of another tokenizer with the same vocabulary size, or
    with no fingerprint at all, is skipped."""
    import threading
    import time

    from rhymerl.drafting import HistoryStore
    from rhymerl.vllm.shared_history import SharedHistory

    for name, fp in (("a", "tok-A"), ("b", "tok-B"), ("c", None)):
        seg = HistoryStore(tokenizer_fingerprint=fp)
        seg.add(name, [1, 2], [[3, 4, 5]], 1)
        seg.save(tmp_path / f"0000000000000000000{ord(name)}-{name}.hist.gz")
    store = HistoryStore()
    share = SharedHistory(tmp_path, store, vocab_size=50, interval_s=0, tokenizer_fingerprint="tok-A")
    slow = threading.Event()
    load = HistoryStore.load

    def slow_load(*a, **k):
        slow.wait(0.5)
        return load(*a, **k)

    monkeypatch.setattr(HistoryStore, "load", staticmethod(slow_load))
    t = time.perf_counter()
    share.tick(now=1.0)
    share.tick(now=2.0)  # the job is still reading: nothing waits
    assert time.perf_counter() - t < 0.3 and "a" not in store
    share.flush()
    assert "a" in store and "b" not in store and "c" not in store and (share.read, share.skipped) == (1, 2)
