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
