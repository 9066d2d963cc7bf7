"""``rhymerl bench e2e``: the same short RL run with speculation off and on, in one invocation.

The variants run side by side in this process, a step each in turn (no held-out
evaluations: only the training steps are timed).

Same seeds give the same tokens, so the two runs learn identically (checked here): only
the time differs. Prompts are revisited every few steps, as in multi-epoch RL, so that
history exists. Reports time per phase per step, the end-to-end speed-up, and plots both
reward curves on one figure.

Variants: no speculation (the baseline), HistoSpec, HistoSpec on 2 worker processes split
evenly and by HistoPipe, async RL (``trainer.async_staleness=1``) without and with HistoSpec,
and the prompt split of mini-batches after the rollout and streamed into it. Async learns
from older weights' batches and the prompt split draws other mini-batches, so their learning
metrics are compared with their own pairs' (:data:`COMPARED_WITH`), not the baseline's.

Every variant also gets the whole-step model's prediction of its step time, from its own
traces and this machine's costs calibrated before and after the runs
(:mod:`rhymerl.bench.calibrate`).
"""
from __future__ import annotations

import gc
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from rhymerl.bench.calibrate import calibrate, describe, mean_costs
from rhymerl.bench.common import bootstrap_interval, print_table, write_report
from rhymerl.training.metrics.logger import read_metrics

SPEED = ("timing_s/", "perf/", "spec/", "pipe/")


def simulated_steps(costs: Any, run_dir: Path, rows: list[dict], *, workers: int, policy: str, in_process: bool,
                    async_rl: bool, max_num_seqs: int, threads: int, drafts: bool,
                    stream: tuple[int, int] | None = None) -> list[dict[str, float]]:
    """The whole-step model's time of every logged step of one variant (``step_s``, with its
    rollout's ``gen_s`` and the trainer's ``train_s`` alone), from the variant's own length and
    forward traces (what speculation did), with ``costs`` measured apart from the runs.
    ``threads``: each worker process's; ``drafts``: the history drafter runs; ``stream``: (seed,
    mini-batches) of a variant whose update streams into its rollout."""
    import json

    from rhymerl.bench.step_model import local_rollout, local_rollout_s, overlapped_s, streamed_s
    from rhymerl.training.update.stream import processing_order, prompt_minibatches

    traces = {t["step"]: t for t in map(json.loads, (run_dir / "traces.jsonl").read_text().splitlines())}
    out = []
    for r in rows:
        t = traces[r["step"]]
        rows_f = r["spec/decode_rows"]
        accepted = r["spec/decode_tokens"] - rows_f
        drafted = accepted / r["spec/acceptance_rate"] if r.get("spec/acceptance_rate") else 0.0
        scored = 1.0 + drafted / max(1.0, rows_f)
        forwards = [[max(1, f) for f in fs] for fs in t["forwards"]]
        shape = dict(predicted=t["predicted"], scored_per_row=scored, max_num_seqs=max_num_seqs, threads=threads,
                     drafts=drafts)
        rollout = local_rollout_s(costs, forwards, t["prompt_lens"], workers=workers, policy=policy,
                                  in_process=in_process, **shape)
        trained = t.get("trained", [True] * len(t["lengths"]))
        tokens = sum(p * len(ls) + sum(ls) for p, ls, k in zip(t["prompt_lens"], t["lengths"], trained) if k)
        train = costs.train_s_per_token * tokens
        if stream is not None:
            seed, mbs = stream
            sim = local_rollout(costs, forwards, t["prompt_lens"], workers=1, policy="even", in_process=False, **shape)
            done, makespan = list(sim.prompt_done_s), sim.makespan_s
            P = len(t["lengths"])
            first = set(prompt_minibatches(P, mbs, seed, r["step"], 0)[0])
            order = processing_order(t["predicted"], P, seed, r["step"])
            per_tok, share = costs.train_s_per_token, costs.logp_share
            g_s = [per_tok * (t["prompt_lens"][g] * len(t["lengths"][g]) + sum(t["lengths"][g])) if trained[g] else 0.0
                   for g in range(P)]
            logp = [g_s[g] * share for g in order]
            grad = [g_s[g] * (1 - share) * (g in first) for g in order]
            slow_r, slow_t, _ = costs.rest_slowdowns(threads)
            step = streamed_s(makespan, [done[g] for g in order], logp, grad, train - sum(logp) - sum(grad),
                              slow_r, slow_t)
        elif async_rl:  # this step's update beside the next batch's rollout (its own process),
            # on the cores the worker leaves, and at that thread count after it too
            step = overlapped_s(rollout, train, *costs.rest_slowdowns(threads))
        else:
            step = rollout + train
        out.append({"step_s": step, "gen_s": rollout, "train_s": train})
    return out


# variant -> the variant its learning metrics must equal (async RL and the prompt split learn
# other things than the baseline; speculation, scheduling and streaming never change them)
COMPARED_WITH = {"async_histospec": "async", "stream": "prompt_split"}


def run(json_path: str | None = None, *, steps: int = 24, quick: bool = False,
        extra: list[str] | None = None, only: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Every variant (or ``only`` those, with the baseline and what they are compared with), a
    step each in turn."""
    from rhymerl.config import load_config
    from rhymerl.training.rl import RLRun
    from rhymerl.training.sft import ensure_base_model

    if quick:
        steps = 10
    base = str(ensure_base_model(load_config()))
    num_train, batch_prompts = 64, 16
    common = [f"model.path={base}", f"trainer.steps={steps}", f"data.num_train={num_train}",
              f"trainer.batch_prompts={batch_prompts}",
              "rollout.n=8", *(extra or [])]
    tmp = Path(tempfile.mkdtemp(prefix="rhymerl-e2e-"))
    # The model's costs are measured apart from the runs, before and after them (the mean of the
    # two): this machine's speed drifts by tens of percent within minutes.
    print("calibrating the whole-step model (before the runs)", flush=True)
    before = calibrate(base, load_config(None, common))
    print("  " + describe(before), flush=True)
    variants = {"baseline": ["rollout.speculative.method=none"], "histospec": ["rollout.speculative.method=history"],
                # two local worker processes (one core each): scheduling off (even split) and on
                "histospec+even2": ["rollout.speculative.method=history", "rollout.workers=2",
                                    "rollout.schedule=even"],
                "histospec+histopipe": ["rollout.speculative.method=history", "rollout.workers=2",
                                        "rollout.schedule=histopipe"],
                # async RL (S=1): the next batch generates in the background while a step trains
                "async": ["rollout.speculative.method=none", "trainer.async_staleness=1"],
                "async_histospec": ["rollout.speculative.method=history", "trainer.async_staleness=1"],
                # the update streamed into the rollout's tail, and the same prompt split after it
                "prompt_split": ["rollout.speculative.method=none", "trainer.minibatch_split=prompts"],
                "stream": ["rollout.speculative.method=none", "trainer.stream_update=true"]}
    if only:
        unknown = sorted(set(only) - set(variants))
        if unknown:
            raise ValueError(f"bench e2e: unknown variant(s) {unknown}; valid: {', '.join(variants)}")
        keep = {"baseline", *only, *(COMPARED_WITH[v] for v in only if v in COMPARED_WITH)}
        variants = {k: v for k, v in variants.items() if k in keep}
    runs: dict[str, RLRun] = {}
    # A full (generation-2) collection scans every variant's objects and would land in whichever
    # variant's step crosses the threshold: the young generations stay automatic (each variant
    # pays for its own allocations) and full collections run between rounds, untimed.
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], 1 << 30)
    try:  # built inside: a variant that fails to start still stops the workers of those before it
        for name, ov in variants.items():
            runs[name] = RLRun(load_config(None, common + ov + [f"trainer.output_dir={tmp / name}"]), tmp / name,
                               progress=False)
        names = list(runs)
        orders = balanced_orders(len(names))
        for step in range(1, steps + 1):
            # The variants take turns, a step each, so the machine's drift falls on all of them
            # alike; the order changes every step so that each variant comes first, and follows
            # each other variant, equally often (what a turn leaves behind, caches or processes
            # winding down, then falls on no variant in particular). See docs/design.md.
            for name in (names[i] for i in orders[(step - 1) % len(orders)]):
                m = runs[name].train_step(step)
                # An async variant's next batch is still generating: it finishes before the next
                # variant's turn (so it never runs beside another variant), and its remainder
                # counts in this step, as it would in a run of its own.
                t = time.perf_counter()
                runs[name].settle()
                m["timing_s/step"] += time.perf_counter() - t
                runs[name].metrics.log(step, m)
            gc.collect()
    finally:
        gc.set_threshold(*thresholds)
        for r in runs.values():
            r.metrics.close()
            r.close()
    print("calibrating the whole-step model (after the runs)", flush=True)
    after = calibrate(base, load_config(None, common))
    print("  " + describe(after), flush=True)
    costs = mean_costs(before, after)
    results = {name: [r for r in read_metrics(tmp / name / "metrics.jsonl") if "timing_s/step" in r]
               for name in runs}
    learn = {k: [{m: v for m, v in r.items() if not m.startswith(SPEED)} for r in rows] for k, rows in results.items()}
    # Speculation and scheduling never change what is learned; async RL does (older weights draw
    # its batches), so the async variants are compared with each other.
    # The prompt split draws other mini-batches than the default: streamed, it must learn what
    # it learns after the rollout.
    same_as = {k: COMPARED_WITH.get(k, k if k in COMPARED_WITH.values() else "baseline") for k in learn}
    # None for the reference variants themselves: a run compared with itself proves nothing
    same = {k: learn[k] == learn[same_as[k]] if same_as[k] != k else None for k in learn}
    rows_out = []
    from rhymerl.distribution.factory import in_process_worker, worker_specs

    shape = {name: dict(workers=r.cfg.rollout.workers, policy=r.cfg.rollout.schedule, in_process=in_process_worker(r.cfg),
                        async_rl=r.cfg.trainer.async_staleness > 0,
                        threads=worker_specs(r.cfg, base)[0].threads or costs.cores,
                        drafts=r.cfg.rollout.speculative.method != "none") for name, r in runs.items()}
    # the first epoch's prompts have no history yet: the "after epoch 1" columns leave it out
    skip = min(num_train // batch_prompts, steps - 1)
    for name, rows in results.items():
        def mean(k: str, rs: list[dict] = rows) -> float:
            return float(np.mean([r[k] for r in rs]))

        late = rows[skip:]
        c = runs[name].cfg
        sim = simulated_steps(costs, tmp / name, rows, max_num_seqs=c.rollout.max_num_seqs,
                              stream=(c.seed, c.trainer.ppo_mini_batches) if c.trainer.stream_update else None,
                              **shape[name])
        sim_step = float(np.mean([x["step_s"] for x in sim]))
        rows_out.append({"variant": name, "step_s": mean("timing_s/step"), "simulated_step_s": sim_step,
                         "sim_error": sim_step / mean("timing_s/step") - 1, "gen_s": mean("timing_s/gen"),
                         "simulated_gen_s": float(np.mean([x["gen_s"] for x in sim])),
                         "simulated_train_s": float(np.mean([x["train_s"] for x in sim])),
                         "update_s": mean("timing_s/update") + mean("timing_s/old_logp"),
                         "step_s_after_epoch1": mean("timing_s/step", late),
                         "gen_s_after_epoch1": mean("timing_s/gen", late),
                         "accepted_per_forward": mean("spec/accepted_per_forward", late),
                         "final_score": rows[-1]["critic/score/mean"], "same_learning_metrics": same[name],
                         "learning_max_rel_diff": max_rel_diff(learn[name], learn[same_as[name]]),
                         "learning_compared_with": same_as[name]})
    base_row = rows_out[0]

    def totals(s: np.ndarray) -> float:
        return float(s[:, 0].sum() / s[:, 1].sum())

    for r in rows_out:
        r["speedup"] = base_row["step_s"] / r["step_s"]
        r["gen_speedup"] = base_row["gen_s"] / r["gen_s"]
        # Steps are paired (each variant's step k ran next to the baseline's), so the interval
        # resamples steps whole: what 24 steps resolve on a machine whose step times move by
        # 10-20 % from step to step (a 2 % difference needs several runs).
        for key, metric in (("speedup_ci95", "timing_s/step"), ("gen_speedup_ci95", "timing_s/gen")):
            pairs = np.array([[b[metric], v[metric]] for b, v in zip(results[base_row["variant"]],
                                                                    results[r["variant"]])])
            r[key] = bootstrap_interval(pairs, totals)
        # what a projection is used for: the speed-up, which the machine's drift moves less
        r["simulated_speedup"] = base_row["simulated_step_s"] / r["simulated_step_s"]
        r["speedup_error"] = r["simulated_speedup"] / r["speedup"] - 1
    print_table(rows_out, ["variant", "step_s", "simulated_step_s", "sim_error", "speedup_error", "gen_s",
                           "simulated_gen_s",
                           "update_s", "simulated_train_s",
                           "gen_s_after_epoch1", "accepted_per_forward",
                           "speedup", "speedup_ci95", "gen_speedup", "gen_speedup_ci95", "final_score",
                           "same_learning_metrics", "learning_max_rel_diff"])
    _plot(results, Path(json_path).with_suffix(".png") if json_path else tmp / "e2e.png")
    try:  # TRL side by side, when the optional `trl` extra is installed
        import trl  # noqa: F401

        from rhymerl.bench.trl_compare import compare

        trl_rows = compare(base, steps=4)
        print_table(trl_rows, ["variant", "work", "step_s", "speedup"])
        rows_out += trl_rows
    except ImportError:
        print("trl not installed: no TRL rows (pip install 'trl==1.16.*' with torch pinned)")
    report = write_report(rows_out, json_path, {"step_s_by_variant": {k: [r["timing_s/step"] for r in rows]
                                                                      for k, rows in results.items()},
                                                "calibration": {"before": describe(before), "after": describe(after)}})
    shutil.rmtree(tmp, ignore_errors=True)
    return report


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` variants in which each comes in every position, and right after each
    other variant, equally often (a Williams design: ``n`` orders for even ``n``, ``2n`` for odd)."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    orders = [[(x + i) % n for x in first] for i in range(n)]
    return orders if n % 2 == 0 else orders + [o[::-1] for o in orders]


def max_rel_diff(a: list[dict], b: list[dict]) -> float:
    """The largest relative difference between two runs' learning metrics, step by step (0.0:
    the same bits). Async RL trains on the engine's own log-probs, whose last bits differ with
    speculation unless ``rollout.invariant=true``: the first steps differ in the last digits,
    and over many steps the policies drift apart until a sampled token differs."""
    worst = 0.0 if len(a) == len(b) else float("inf")
    for x, y in zip(a, b):
        for k in x.keys() | y.keys():
            u, v = x.get(k), y.get(k)
            if u == v:
                continue
            if not isinstance(u, (int, float)) or not isinstance(v, (int, float)):
                return float("inf")
            worst = max(worst, abs(u - v) / max(abs(u), abs(v), 1e-12))
    return worst


def _plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, rows in results.items():
        steps = [r["step"] for r in rows]
        ax[0].plot(steps, [r["critic/score/mean"] for r in rows], label=name, linestyle="--" if name != "baseline" else "-")
        ax[1].plot(steps, [r["timing_s/gen"] for r in rows], label=name)
    ax[0].set_title("train reward (identical by construction)")
    ax[1].set_title("rollout seconds per step")
    for a in ax:
        a.set_xlabel("step")
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")
