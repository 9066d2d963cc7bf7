"""``rhymerl bench pipe``: HistoPipe against even split, least-loaded routing and two oracles.

Two tables from one invocation:

- measured: real rollout steps of the built-in task (the main job's 32 prompts x 8 samples)
  on 2 and 4 local worker processes, speculation off (scheduling alone, with the
  simulator's prediction of each step) and on; every policy on the same prompts, seeds and
  weights (so the same tokens, checked), the policies timed in turn, step by step;
- simulated: the discrete-event simulator at 256 and 1,024 workers (16 prompts x 16 samples
  per worker), on our recorded length traces and on synthetic long-tailed ones, with the
  worker cost curve profiled here and with a GPU-shaped one. Beside the oracle (every
  sample's true length), ``prompt_oracle`` plans from each prompt's realized lengths without
  knowing which sibling is which, and on a synthetic trace ``dist_oracle`` from each
  prompt's true length distribution without the draw, and ``history_oracle`` from the exact
  distribution of its previous epoch (before the drift between epochs): the most any history
  of earlier epochs could know.
"""
from __future__ import annotations

import collections
import functools
import json
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from rhymerl.bench.common import paired_ratio, print_table, write_report
from rhymerl.scheduling import GPU_8B_H100, ORACLES, POLICIES, StepCost, make_plan, simulate, spearman
from rhymerl.scheduling.length_predictor import log_error_sigma, predicted_samples
from rhymerl.scheduling.placement_scores import PlacementScores

N_SAMPLES = 8  # the default recipe's group size
TRACE_SCALE_GPU = 64  # recorded arith lengths (tens of tokens) scaled to reasoning lengths for the GPU model
FAST_CHANGE_STEPS = 40  # a trace of a run's first steps: the policy changes fast there, history predicts worse


# --- traces --------------------------------------------------------------------------------------
def trace_pairs(path: Path, last_step: int | None = None) -> tuple[list[tuple[list[int], list[int]]], float]:
    """(previous epoch's lengths, this epoch's lengths) for every prompt seen twice in a run's
    traces (up to ``last_step``), and the mean prompt length in tokens."""
    last: dict[str, list[int]] = {}
    pairs = []
    prompt_lens: list[int] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if last_step is not None and rec.get("step", 0) > last_step:
            break
        prompt_lens += rec["prompt_lens"]
        for key, lens in zip(rec["keys"], rec["lengths"]):
            if key in last:
                pairs.append((last[key], lens))
            last[key] = lens
    return pairs, float(np.mean(prompt_lens)) if prompt_lens else 0.0


def stat_correlations(pairs: list[tuple[list[int], list[int]]]) -> dict[str, float]:
    """Rank correlation between each length statistic of a prompt's previous epoch and the
    mean length of its next one: how well each predicts the order HistoPipe plans by."""
    from rhymerl.scheduling.length_predictor import STATS

    true = [float(np.mean(c)) for _, c in pairs]
    return {name: spearman([f(np.asarray(p, dtype=np.float64)) for p, _ in pairs], true)
            for name, f in STATS.items()}


# Synthetic traces: per prompt a typical length (log-normal or Pareto), each epoch's samples
# log-normal around it with ``spread``, and the typical length moving by ``drift`` (log sd)
# between epochs. ``reasoning``'s values are chosen to reproduce published figures of
# reasoning RL at 32K tokens (docs/traces.md; the bench measures both on the trace): only
# 2-4 % of prompts change length rank much between epochs (RhymeRL), and the last 10 % of
# requests take about half of a synchronous rollout (Seer, even split).
SYNTHETIC = {
    "lognormal": {"typical": ("lognormal", 1500, 0.8), "spread": 0.35, "drift": 0.15},
    "heavy_tail": {"typical": ("pareto", 600, 1.3), "spread": 0.5, "drift": 0.15},
    "reasoning": {"typical": ("lognormal", 4000, 0.7), "spread": 0.4, "drift": 0.15},
}
MAX_TOKENS = 32768
SYNTHETIC_PROMPTS = 16384  # distinct prompts for the largest simulated step (1,024 workers x 16)


@dataclass(frozen=True)
class SyntheticTrace:
    """A synthetic trace's (previous epoch, next epoch) lengths per prompt, and what each
    epoch's samples were drawn from: per prompt a log-normal with median ``medians[i]`` (the
    next epoch; ``previous_medians[i]`` the previous one, before its drift) and log sd
    ``spread``, clipped to [16, MAX_TOKENS]."""

    pairs: list[tuple[list[int], list[int]]]
    medians: np.ndarray
    spread: float
    previous_medians: np.ndarray | None = None

    def quantiles(self, i: int, n: int, previous: bool = False) -> list[float]:
        """``n`` evenly spaced quantiles of prompt ``i``'s next-epoch distribution (``previous``:
        the previous epoch's): it knows the distribution, not the draw."""
        m = self.previous_medians[i] if previous and self.previous_medians is not None else self.medians[i]
        return np.clip(m * np.exp(self.spread * _normal_quantiles(n)), 16, MAX_TOKENS).tolist()


@functools.lru_cache(maxsize=None)
def _normal_quantiles(n: int) -> np.ndarray:
    """``n`` evenly spaced quantiles of the standard normal (the same for every prompt)."""
    z = np.array([NormalDist().inv_cdf((k + 0.5) / n) for k in range(n)])
    z.setflags(write=False)  # shared by every call
    return z


def synthetic_trace(kind: str, count: int, n: int, rng: np.random.Generator) -> SyntheticTrace:
    """``count`` prompts x ``n`` samples of a :data:`SYNTHETIC` trace, two epochs."""
    if kind not in SYNTHETIC:
        raise ValueError(f"synthetic trace {kind!r} is not one of {sorted(SYNTHETIC)}")
    spec = SYNTHETIC[kind]
    shape, scale, param = spec["typical"]
    if shape == "lognormal":
        typical = rng.lognormal(np.log(scale), param, size=count)
    else:  # math reasoning: most answers short, a Pareto tail of very long ones
        typical = scale * (1 + rng.pareto(param, size=count))
    spread = spec["spread"]
    drift = rng.lognormal(0, spec["drift"], size=count)

    def draw(t: np.ndarray) -> list[list[int]]:
        x = rng.lognormal(np.log(t)[:, None], spread, size=(count, n))
        return np.clip(x, 16, MAX_TOKENS).astype(int).tolist()

    prev, cur = draw(typical), draw(typical * drift)
    return SyntheticTrace(list(zip(prev, cur)), typical * drift, spread, typical)


def synthetic_pairs(kind: str, count: int, n: int, rng: np.random.Generator) -> list[tuple[list[int], list[int]]]:
    """(previous epoch, next epoch) lengths of ``count`` prompts x ``n`` samples of a
    :data:`SYNTHETIC` trace."""
    return synthetic_trace(kind, count, n, rng).pairs


def rank_change_fraction(pairs: list[tuple[list[int], list[int]]], by: float = 0.2) -> float:
    """Share of prompts whose mean-length rank moves by more than ``by`` (as a fraction of
    the prompts) from one epoch to the next: RhymeRL's "prompts that change rank much"."""
    if len(pairs) < 2:
        return 0.0
    a = np.argsort(np.argsort([np.mean(p) for p, _ in pairs])) / (len(pairs) - 1)
    b = np.argsort(np.argsort([np.mean(c) for _, c in pairs])) / (len(pairs) - 1)
    return float(np.mean(np.abs(a - b) > by))


def pick_prompts(count: int, prompts: int, rng: np.random.Generator) -> np.ndarray:
    """Which of a trace's ``count`` prompts a step of ``prompts`` holds: distinct while the
    trace has enough (a batch never holds a prompt twice, and a pair drawn twice would put two
    prompts with the same prediction error side by side, which a placement that ranks prompts
    by risk then packs onto one worker), with replacement beyond."""
    return rng.permutation(count)[:prompts] if count >= prompts else rng.integers(0, count, size=prompts)


def scaled_workload(pairs: list[tuple[list[int], list[int]]], prompts: int, n: int, scale: float,
                    rng: np.random.Generator, idx: np.ndarray | None = None) -> tuple[list[list[int]], np.ndarray]:
    """``prompts`` prompts of ``n`` samples drawn from trace pairs (``idx``: the ones
    :func:`pick_prompts` picked, else picked here): true lengths and predictions; a prompt's
    samples are its next epoch's lengths in random order (resampled if fewer than n)."""
    if idx is None:
        idx = pick_prompts(len(pairs), prompts, rng)
    true, prev = [], []
    for i in idx:
        p, c = pairs[i]
        c = np.asarray(c)
        drawn = rng.permutation(c)[:n] if len(c) >= n else c[rng.integers(0, len(c), size=n)]
        true.append(np.maximum(1, drawn * scale).astype(int).tolist())
        prev.append([x * scale for x in p])
    return true, prev


@dataclass(frozen=True)
class SimSource:
    """One trace of the simulated table: its (previous, next) pairs, the factor its lengths are
    scaled by, the workers' cost curve, the mean prompt length, the length limit, and for a
    synthetic trace what its next epoch was drawn from (a ``dist_oracle`` row)."""

    pairs: list[tuple[list[int], list[int]]]
    scale: float
    cost: StepCost
    prompt_len: float
    max_tokens: float
    truth: SyntheticTrace | None = None


LEARNT_STEPS = 2  # earlier steps HistoPipe's placement is scored on in the simulated table


def simulated_rows(sources: dict[str, SimSource], worker_counts: list[int], n: int = 16,
                   per_worker_prompts: int = 16) -> list[dict[str, Any]]:
    """Every policy on each trace; on a synthetic trace also ``dist_oracle``: HistoPipe's
    planner given each prompt's true length distribution (what the next epoch's samples were
    drawn from, not the draw itself), and ``history_oracle``: the same planner given the
    previous epoch's exact distribution, with the error of its means priced as histopipe's is
    (the drift between epochs, which no history can see): the best any prediction from
    earlier epochs could do.

    HistoPipe prices its prediction error, measured as a coordinator does on its last step:
    here the log error of the trace's (previous epoch -> next epoch) mean lengths."""
    rows = []
    for name, src in sources.items():
        # Each trace draws its workloads from its own seed: its rows do not depend on which
        # other traces ran before it (the built-in task's exist only after a main-job run).
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        pairs, scale, cost = src.pairs, src.scale, src.cost
        err = log_error_sigma([np.mean(p) for p, _ in pairs], [np.mean(c) for _, c in pairs])
        for R in worker_counts:
            idx = pick_prompts(len(pairs), R * per_worker_prompts, rng)
            true, prev = scaled_workload(pairs, R * per_worker_prompts, n, scale, rng, idx)
            guess = predicted_samples(prev, [n] * len(prev))
            # HistoPipe's placement as a coordinator learns it: scored on earlier steps of the same
            # trace (other prompts, their actual lengths), never on this step's.
            learnt = PlacementScores()
            for k in range(LEARNT_STEPS):
                before = np.random.default_rng(zlib.crc32(f"{name}:{R}:{k}".encode()))
                t_k, p_k = scaled_workload(pairs, R * per_worker_prompts, n, scale, before)
                learnt.observe(predicted_samples(p_k, [n] * len(p_k)), t_k, R, cost=cost, max_num_seqs=256,
                               prompt_len=src.prompt_len, error_sigma=err, max_tokens=src.max_tokens * scale)
            plans: dict[str, tuple[list, float]] = {p: (true if p in ORACLES else guess, err) for p in POLICIES}
            if src.truth is not None:
                dist = [[x * scale for x in src.truth.quantiles(i, n)] for i in idx]
                plans["dist_oracle"] = (dist, log_error_sigma([np.mean(d) for d in dist], [np.mean(t) for t in true]))
                if src.truth.previous_medians is not None:
                    before = [[x * scale for x in src.truth.quantiles(i, n, previous=True)] for i in idx]
                    plans["history_oracle"] = (before, log_error_sigma([np.mean(d) for d in before],
                                                                      [np.mean(t) for t in true]))
            res = {}
            for label, (lens, sigma) in plans.items():
                t = time.perf_counter()
                policy = "histopipe" if label in ("dist_oracle", "history_oracle") else label
                placement, moves = learnt.choose() if label == "histopipe" else ("auto", True)
                plan = make_plan(policy, lens, R, cost=cost, max_num_seqs=256, prompt_len=src.prompt_len,
                                 error_sigma=sigma, max_tokens=src.max_tokens * scale, placement=placement,
                                 migrate=moves)
                plan_s = time.perf_counter() - t
                r = simulate(plan, true, int(src.prompt_len), cost, max_num_seqs=256)
                res[label] = r
                rows.append({"source": "simulated", "trace": name, "cost": cost.name, "workers": R,
                             "prompts": len(true), "samples": n, "policy": label, "makespan_s": r.makespan_s,
                             "bubble_fraction": r.bubble_fraction, "tok_s": r.tokens_per_s,
                             "migrations": r.migrations, "steals": r.steals, "length_error_sigma": sigma,
                             "tail_share": r.tail_share,
                             "plan_s": plan_s, "sim_wall_s": time.perf_counter() - t,
                             "placement": f"{plan.placement}+{plan.migrate}" if label == "histopipe" else ""})
            for row in rows[-len(plans):]:
                row["vs_even"] = res["even"].makespan_s / row["makespan_s"]
                row["vs_oracle"] = row["makespan_s"] / res["oracle"].makespan_s
                row["vs_prompt_oracle"] = row["makespan_s"] / res["prompt_oracle"].makespan_s
                row["vs_least_loaded"] = row["makespan_s"] / res["least_loaded"].makespan_s
            print(f"  simulated {name:>12} R={R:5d}: " + ", ".join(
                f"{p} {r.makespan_s:.1f}s/{r.bubble_fraction:.2f}" for p, r in res.items()), flush=True)
    return rows


def profile_now(model: str, threads: int) -> StepCost:
    """A worker's step-time curve with ``threads`` threads, timed now."""
    from rhymerl.config import load_config
    from rhymerl.distribution.factory import profile_cost

    cfg = load_config()
    cfg.rollout.max_num_seqs = 256
    return profile_cost(model, cfg, threads).scaled(1.0, f"profiled here ({threads} thread"
                                                         f"{'s' if threads > 1 else ''}/worker)")


# for the simulated tables: one curve per thread count and bench run
profiled_cost = functools.lru_cache(maxsize=None)(profile_now)


# --- measured --------------------------------------------------------------------------------------
def _cpu_seconds(pool: Any) -> float | None:
    """CPU seconds used so far by this process and the pool's worker processes (Linux ``/proc``);
    None where they cannot be read (another OS, or workers that are not local processes)."""
    total = time.process_time()
    clock = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for h in pool.alive():
        proc = getattr(h, "proc", None)
        if proc is None:
            return None
        try:
            with open(f"/proc/{proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        total += (int(fields[11]) + int(fields[12])) / clock  # utime + stime
    return total


def worker_cost_factor(co: Any, probe: list, R: int, cost: StepCost, cores: int, threads: int,
                       reps: int = 2) -> tuple[float, float]:
    """How much slower a worker process runs than ``cost`` (profiled in this process) says:
    ``probe`` (prompts apart from the measured steps) is run with a copy on every worker at once,
    and the time is compared with the simulator's for the same, its ``R`` workers sharing
    ``cores``. This folds in what the curve and the core sharing cannot see: the coordinator's
    round trips, and processes contending for more than cores (memory, caches).
    Returns (factor, slowdown of all-at-once against worker 0 alone)."""
    from rhymerl.scheduling.plan import Plan, WorkUnit

    units = [WorkUnit(i, tuple(range(q.params.n))) for i, q in enumerate(probe)]
    alone = Plan("even", [units] + [[] for _ in range(R - 1)])
    together = Plan("even", [[WorkUnit(w * len(probe) + u.prompt, u.samples) for u in units] for w in range(R)])

    def best(reqs: list, plan: Any) -> tuple[float, list]:
        out, outs = float("inf"), []
        for _ in range(reps):
            t = time.perf_counter()
            outs = co.rollout(reqs, 0, plan=plan)
            out = min(out, time.perf_counter() - t)
        return out, outs

    t_alone, outs = best(probe, alone)
    t_all, _ = best(probe * R, together)
    lengths = [[len(c.token_ids) for c in o.outputs] for o in outs]
    sim = simulate(together, lengths * R, [len(q.prompt_ids) for q in probe] * R, cost, max_num_seqs=256,
                   cores=cores, threads=threads)
    return t_all / sim.makespan_s, t_all / t_alone


def measured_rows(model: str, worker_counts: list[int], steps: int, batch: int, rounds: int,
                  modes: tuple[bool, ...] = (False,), engine: str = "native") -> tuple[list[dict], tuple[list, float]]:
    """Rollout time of ``steps`` real steps of ``batch`` prompts x 8 samples (the main job's
    step) per policy, after an epoch that gave every prompt a history. Each step runs once
    untimed, then ``rounds`` rounds of every policy in turn; a policy's makespan is the median
    over rounds of its time per step, with the range. Also returns this bench's (previous,
    next) length pairs and mean prompt length, a trace of its own.

    ``core_utilisation`` is the CPU time of the workers and this process over cores x wall
    time: where even split's is near 1, the cores are already busy and no schedule that does
    the same work can be much faster (at most ``1 / utilisation``).

    ``modes``: speculation off and/or on. With it on, the workers draft from that epoch
    (HistoSpec, the main job's settings), as in the system's real configuration; the
    simulator has no model of speculation, so those rows carry no prediction (and the
    calibration that serves it is skipped). Both modes share the epoch and the true lengths:
    speculation must not change a token, and the bench checks it does not.

    ``engine``: ``native`` (rhymerl's engine in worker processes) or ``vllm`` (one vLLM engine
    per worker). vLLM's numerics follow its batch, so a schedule may change a few tokens
    there: the rows count the samples that differ instead of refusing them, and carry no
    simulation (the curve is rhymerl's engine's)."""
    from rhymerl.config import load_config
    from rhymerl.data.splits import task_splits
    from rhymerl.distribution import RolloutCoordinator, RolloutRequest, WorkerSpec, make_pool
    from rhymerl.distribution.factory import worker_specs
    from rhymerl.drafting import HistoryStore
    from rhymerl.engine import SamplingParams
    from rhymerl.model import load_pretrained
    from rhymerl.tokenizer import encode_prompt, load_tokenizer
    from rhymerl.training.rollout.phase import rollout_seed

    cfg = load_config()
    tok = load_tokenizer(model)
    all_rows = task_splits(cfg.data, cfg.seed)[0]
    rows_data = all_rows[: steps * batch]
    r = cfg.rollout
    exact = engine == "native"  # the same seeds give the same tokens under any schedule

    def requests(rows: list, step: int) -> list:
        # Only the first epoch enters the history: every policy must plan and draft from the
        # same state, never from the steps being measured.
        return [RolloutRequest(encode_prompt(tok, row.prompt),
                               SamplingParams(n=N_SAMPLES, temperature=r.temperature, max_tokens=r.max_tokens),
                               rollout_seed(cfg.seed, step, row.key), row.key) for row in rows]

    named = dict(load_pretrained(model).named_parameters())
    cores = os.cpu_count() or 1
    store = HistoryStore()
    # epoch 1 (in one in-process worker) gives every prompt the history HistoPipe predicts from
    pool = make_pool("local", [WorkerSpec(model, max_num_seqs=256, max_model_len=r.max_model_len, threads=0)], named)
    first = RolloutCoordinator(pool, policy="even", history=store, max_num_seqs=256)
    first_reqs = requests(rows_data, 1)
    for q, o in zip(first_reqs, first.rollout(first_reqs, 1)):
        store.add(q.prompt_key, q.prompt_ids, [c.token_ids for c in o.outputs], 1)
    pool.close()
    batches = [requests(rows_data[i * batch:(i + 1) * batch], 2 + i) for i in range(steps)]
    probe = requests(all_rows[steps * batch: steps * batch + 8], 0)  # calibration, apart from the steps
    out_rows: list[dict] = []
    pairs: list = []
    truth: list[list[list[int]]] = []
    for speculation, R in [(m, R) for m in modes for R in worker_counts]:
        if R == worker_counts[0]:
            mode = "on (drafts from the first epoch)" if speculation else "off"
            where = "local worker processes" if engine == "native" else "one vLLM engine per worker"
            print(f"measured: {where}, speculation {mode}, same prompts/seeds/weights for every policy", flush=True)
        speculative = worker_specs(cfg, model)[0].speculative if speculation else None
        threads = max(1, cores // R)
        # timed right before the runs it predicts: this machine's speed drifts within a bench
        base_cost = profile_now(model, threads)
        # Every run of a step drafts from the first epoch alone: a vLLM engine recording what it
        # finished would hand a repeated step's later runs its own earlier responses (to the
        # policies that put a prompt on the same engine again).
        specs = [WorkerSpec(model, max_num_seqs=256, max_model_len=r.max_model_len, threads=threads, seed=i,
                            speculative=speculative, engine=engine, record_history=False) for i in range(R)]
        pool = make_pool("local", specs, named)
        co = RolloutCoordinator(pool, history=store, cost=base_cost, max_num_seqs=256, slice_s=0.05,
                                cores=float(cores), threads=threads)
        warm = requests(rows_data[: 4 * R], 0)
        shipped = store if speculation else None  # drafts need the history on the workers
        co.history = shipped
        co.rollout(warm, 0, plan=co.plan(warm, 0, policy="even"))
        sim_cost = base_cost
        simulated = exact and not speculation
        if simulated:  # one scale for the simulator's curve, measured on prompts the steps do not use
            factor, together = worker_cost_factor(co, probe, R, base_cost, cores, threads)
            sim_cost = co.cost = base_cost.scaled(factor, f"{base_cost.name} x{factor:.2f} (worker processes)")
            print(f"  R={R}: {threads} thread(s) per worker; probe: all {R} at once x{together:.2f} the time of "
                  f"one alone, x{factor:.2f} the in-process curve's with {R} sharing {cores} cores", flush=True)
        policies = ("even", "least_loaded", "histopipe", "oracle")
        chosen: collections.Counter[str] = collections.Counter()
        acc = {p: {"round_s": [0.0] * rounds, "busy": 0.0, "cpu": 0.0, "sim": 0.0, "moved": 0, "tokens": 0,
                   "differ": 0} for p in policies}
        for i, reqs in enumerate(batches):
            co.history = store
            warm_plan = co.plan(reqs, 2 + i, policy="even")
            co.history = shipped
            # Untimed first: the oracle's true lengths, and the batch warm before any policy is timed.
            tokens = [[c.token_ids for c in o.outputs] for o in co.rollout(reqs, 2 + i, plan=warm_plan)]
            lengths = [[len(t) for t in o] for o in tokens]
            if len(truth) <= i:
                truth.append(lengths)
                pairs += [(store.lengths(q.prompt_key), lens) for q, lens in zip(reqs, lengths)]
            elif lengths != truth[i] and exact:
                raise AssertionError("the same seeds gave other lengths")
            co.history = store
            plans = {p: co.plan(reqs, 2 + i, policy=p, true_lengths=lengths) for p in policies}
            hp = plans["histopipe"]  # its placement, learnt from the steps before
            chosen[f"{hp.placement} + {'migration' if hp.migrate else 'static'}"] += 1
            co.history = shipped
            # Policies take turns, in an order that rotates by step and round, so the machine's
            # drift falls on all of them alike.
            for rnd in range(rounds):
                k = (i + rnd) % len(policies)
                for policy in policies[k:] + policies[:k]:
                    a = acc[policy]
                    b0, m0 = sum(co.busy_s.values()), co.pipe.migrations + co.pipe.steals
                    c0 = _cpu_seconds(pool)
                    t = time.perf_counter()
                    outs = co.rollout(reqs, 2 + i, plan=plans[policy])
                    dt = time.perf_counter() - t
                    c1 = _cpu_seconds(pool)
                    got = [[c.token_ids for c in o.outputs] for o in outs]
                    differ = sum(x != y for g, h in zip(got, tokens) for x, y in zip(g, h))
                    if differ and exact:
                        raise AssertionError(f"{policy}: the same seeds gave other tokens")
                    a["round_s"][rnd] += dt
                    a["busy"] += sum(co.busy_s.values()) - b0
                    a["cpu"] += c1 - c0 if c0 is not None and c1 is not None else float("nan")
                    a["moved"] += co.pipe.migrations + co.pipe.steals - m0
                    a["tokens"] += sum(len(x) for g in got for x in g)
                    a["differ"] += differ
            if simulated:
                for policy in policies:
                    acc[policy]["sim"] += simulate(plans[policy], lengths, [len(q.prompt_ids) for q in reqs], sim_cost,
                                                   max_num_seqs=256, cores=cores, threads=threads).makespan_s
        results = {p: _measured_result(a, steps, rounds, R, cores) for p, a in acc.items()}
        pool.close()
        for policy, res in results.items():
            sim = {} if not simulated else {"simulated_s": res["simulated_s"],
                                            "sim_error": res["simulated_s"] / res["step_s"] - 1}
            out_rows.append({"source": "measured", "trace": "arith", "engine": engine, "cost": sim_cost.name,
                             "workers": R, "speculation": speculation, "prompts": batch, "samples": N_SAMPLES,
                             "steps": steps, "rounds": rounds, "policy": policy, "makespan_s": res["step_s"],
                             "placement": ", ".join(f"{k} x{v}" for k, v in chosen.most_common())
                             if policy == "histopipe" else "",
                             # how far the simulator misprices one worker's share against another's here
                             **({"share_error": co.placements.share_error} if policy == "histopipe" else {}),
                             "makespan_lo_s": res["lo_s"], "makespan_hi_s": res["hi_s"],
                             "bubble_fraction": res["bubble_fraction"], "core_utilisation": res["core_utilisation"],
                             "tok_s": res["tok_s"], "moved": res["moved"], "samples_differ": res["differ"],
                             "vs_even": results["even"]["step_s"] / res["step_s"],
                             # per round against least-loaded's time in the same round (drift cancels)
                             **paired_ratio(acc[policy]["round_s"], acc["least_loaded"]["round_s"], "vs_least_loaded"),
                             "measured_s": res["step_s"], **sim})
        print(f"  measured R={R} (rollout s per step, median [min, max] of {rounds} rounds): " + ", ".join(
            f"{p} {results[p]['step_s']:.3f} [{results[p]['lo_s']:.3f}, {results[p]['hi_s']:.3f}]"
            + (f" (sim {results[p]['simulated_s']:.3f})" if simulated else "") for p in results), flush=True)
        util = results["even"]["core_utilisation"]
        if not np.isnan(util):  # NaN where the engine's processes cannot be read
            print(f"  measured R={R}: even split keeps {util:.0%} of the {cores} cores busy: filling the rest, a "
                  f"schedule doing the same work could be at most {1 / util:.2f}x faster", flush=True)
    return out_rows, (pairs, float(np.mean([len(q.prompt_ids) for b in batches for q in b])))


def _measured_result(a: dict, steps: int, rounds: int, R: int, cores: int) -> dict:
    """One policy's measured row from its per-round totals: the median time per step and the range
    over rounds; bubbles, core use and throughput over every round."""
    per_step = sorted(t / steps for t in a["round_s"])
    total = sum(a["round_s"])
    return {"step_s": float(np.median(per_step)), "lo_s": per_step[0], "hi_s": per_step[-1],
            "bubble_fraction": max(0.0, 1 - a["busy"] / (R * total)), "core_utilisation": a["cpu"] / (cores * total),
            "tok_s": a["tokens"] / total, "simulated_s": a["sim"] / steps, "moved": a["moved"] // rounds,
            "differ": a["differ"] // rounds}


def run(json_path: str | None = None, *, quick: bool = False, traces: str | None = None,
        speculation: bool = True, measured: bool = True, engine: str = "native", rounds: int | None = None) -> dict:
    """Both tables; ``measured=False``: the simulated one alone (on the main job's traces if any)."""
    from rhymerl.bench.spec import _default_model
    from rhymerl.config import load_config

    rows: list[dict] = []
    bench_pairs: tuple[list, float] = ([], 0.0)
    if measured:
        model = _default_model()
        print(f"model: {model}")
        counts, steps, n = ([2], 3, 1) if quick else ([2, 4], 8, 5)
        rows, bench_pairs = measured_rows(model, counts, steps=steps, batch=32, rounds=rounds or n,
                                          modes=(False, True) if speculation else (False,), engine=engine)
    trace_path = Path(traces) if traces else None
    if trace_path is None:
        from rhymerl.training.rl import run_dir_for

        cand = run_dir_for(load_config()) / "traces.jsonl"
        trace_path = cand if cand.exists() else None
    pairs, prompt_len = trace_pairs(trace_path) if trace_path is not None else ([], 0.0)
    source = f"recorded ({trace_path})" if pairs else "this bench's two epochs"
    if not pairs:
        pairs, prompt_len = bench_pairs
    sources: dict[str, SimSource] = {}
    corrs: dict[str, float] = {}
    if pairs:
        corrs = stat_correlations(pairs)
        print(f"length traces: {source}: {len(pairs)} (previous, next) epoch pairs; rank correlation of each "
              f"statistic of the previous epoch's lengths with the next epoch's mean length: "
              + ", ".join(f"{k} {v:.3f}" for k, v in corrs.items()))
        cpu = profiled_cost(_default_model(), 1)
        arith_max = float(load_config().rollout.max_tokens)
        sources["arith_trace"] = SimSource(pairs, 1.0, cpu, prompt_len, arith_max)
        sources["arith_trace_x64"] = SimSource(pairs, float(TRACE_SCALE_GPU), GPU_8B_H100, 256.0, arith_max)
        early = trace_pairs(trace_path, FAST_CHANGE_STEPS)[0] if trace_path is not None else []
        if len(early) >= 64:  # the run's first steps, while the policy learns the format and lengths move
            print(f"length traces: the first {FAST_CHANGE_STEPS} steps: {len(early)} pairs; rank correlation of "
                  f"means {stat_correlations(early)['mean']:.3f}")
            sources[f"arith_first{FAST_CHANGE_STEPS}_x64"] = SimSource(early, float(TRACE_SCALE_GPU), GPU_8B_H100,
                                                                      256.0, arith_max)
    else:
        print("no length traces of the built-in task (no main-job run, no measured steps): its rows are skipped")
    rng = np.random.default_rng(1)
    for kind in SYNTHETIC:
        truth = synthetic_trace(kind, SYNTHETIC_PROMPTS, 16, rng)
        sources[kind] = SimSource(truth.pairs, 1.0, GPU_8B_H100, 256.0, float(MAX_TOKENS), truth)
    for kind in SYNTHETIC:
        print(f"trace {kind}: {rank_change_fraction(sources[kind].pairs):.1%} of prompts change length rank by more "
              f"than 20 % of the prompts between epochs (RhymeRL reports 2-4 %)")
    print("simulated: 16 prompts x 16 samples per worker, 256 slots per worker")
    rows += simulated_rows(sources, [256] if quick else [256, 1024])
    print()
    print_table(rows, ["source", "trace", "engine", "workers", "speculation", "policy", "placement", "makespan_s",
                       "makespan_lo_s", "makespan_hi_s",
                       "bubble_fraction", "core_utilisation", "vs_even", "vs_oracle", "vs_prompt_oracle", "vs_least_loaded",
                       "vs_least_loaded_lo", "vs_least_loaded_hi", "tail_share", "plan_s", "simulated_s", "sim_error",
                       "share_error", "moved", "migrations", "steals", "samples_differ"])
    return write_report(rows, json_path, {"length_rank_correlation": corrs.get("mean"),
                                           "length_rank_correlation_by_stat": corrs})


__all__ = ["SYNTHETIC", "SimSource", "SyntheticTrace", "measured_rows", "rank_change_fraction", "run",
           "simulated_rows", "synthetic_pairs", "synthetic_trace", "trace_pairs"]
