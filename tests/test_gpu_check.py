"""The lent GPU machine's script, proven here: ``scripts/gpu_check.sh --dry-run`` from a copy of
the source tree, with an interpreter that has the machine's kind of packages but not rhymerl
installed, and pip blocked (the GPU machine is offline). Every phase must end ok, with its
report on disk, and rhymerl imported from the copy."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _source_copy(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dst / f)


def _bare_python(venv: Path) -> Path:
    """A venv without pip and without rhymerl: this interpreter's packages reach it through a
    path line (.pth files there, the editable install's finder among them, are not run)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "machine_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin" / "python"


@pytest.mark.slow
def test_gpu_check_dry_run_offline_without_the_project_installed(tmp_path):
    src, out, shims = tmp_path / "src", tmp_path / "out", tmp_path / "shims"
    _source_copy(src)
    py = _bare_python(tmp_path / "venv")
    shims.mkdir()
    for name in ("pip", "pip3"):  # any pip call is recorded and fails, as offline
        (shims / name).write_text(f"#!/bin/sh\ntouch {tmp_path}/pip_called\nexit 1\n")
        (shims / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=f"{shims}:{env['PATH']}", PYTHON=str(py), OUT=str(out), PIP_NO_INDEX="1")
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=src, env=env, capture_output=True,
                       text=True, timeout=900)
    report = json.loads((out / "gpu_check.json").read_text())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert not (tmp_path / "pip_called").exists()
    phases = report["phases"]
    assert list(phases) == ["env", "parity", "base", "identity", "speed", "vllm"]
    assert all(p["ok"] for p in phases.values()), phases
    assert phases["env"]["rhymerl_from"] == str(src / "rhymerl")
    assert phases["identity"]["greedy_identical_with_histospec"] and phases["identity"]["invariant_identical_batch_4_vs_64"]
    methods = {(r["max_num_seqs"], r["method"]) for r in phases["speed"]["rows"]}
    assert methods == {(b, m) for b in (8, 32) for m in ("none", "histospec_path", "histospec_tree", "draft_model")}
    assert (out / "gpu_check.log").read_text().count("[gpu_check]") >= 6


def _script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_each_verdict_fails_on_the_broken_case():
    """What the audit saw pass: a base at 0 % whose every response ran to the cap, identity at
    1.03 tokens per forward, a 1.63x inside an A/A spread of 2.14."""
    g = _script()
    assert not g.base_learnt({"heldout_greedy_accuracy": 0.0, "format_ok": 0.0}, g.DRY)
    assert not g.base_learnt({"heldout_greedy_accuracy": 0.15, "format_ok": 0.9}, g.GPU)
    assert g.base_learnt({"heldout_greedy_accuracy": 0.3, "format_ok": 0.9}, g.GPU)
    same = {"greedy_identical_with_histospec": True, "invariant_identical_batch_4_vs_64": True}
    assert not g.drafted_identically({**same, "history_accepted_per_forward_all_epochs": 1.03})
    assert g.drafted_identically({**same, "history_accepted_per_forward_all_epochs": 1.4})
    assert g._beyond_noise({"speedup": 1.63, "aa_noise": 2.14}) is False
    assert g._beyond_noise({"speedup": 1.3, "aa_noise": 0.05}) is True


def test_the_whole_check_fits_the_devices_command_limit():
    """The build's and the Python part's timeouts together stay at or under 540 s."""
    import re

    sh = (ROOT / "scripts" / "gpu_check.sh").read_text()
    timeouts = [int(t) for t in re.findall(r"timeout (\d+) \$PY", sh)]
    assert len(timeouts) == 2 and sum(timeouts) <= 540
    assert f"default={timeouts[1] - 15}" in (ROOT / "scripts" / "gpu_check.py").read_text()
