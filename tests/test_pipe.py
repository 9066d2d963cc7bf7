"""HistoPipe: length prediction, plans, the simulator, the coordinator, worker faults."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from rhymerl.distribution import InprocPool, RolloutCoordinator, RolloutRequest, WorkerSpec, make_pool
from rhymerl.drafting import HistoryStore
from rhymerl.engine import RequestOutput, SamplingParams
from rhymerl.llm import LLM
from rhymerl.scheduling import GPU_8B_H100, StepCost, make_plan, predict_lengths, simulate, spearman
from rhymerl.scheduling.length_predictor import log_error_sigma, predicted_samples
from rhymerl.scheduling.length_risk import GroupTime, LengthDists, cut_contiguous
from rhymerl.scheduling.plan import Plan, WorkUnit
from rhymerl.scheduling.planner import PLACEMENTS, POLICIES, estimate_s
from tests.helpers import tokens_of

FLAT = StepCost((1, 64), (1.0, 1.0), 0.0, "flat")  # every step 1 s, whatever the batch
LINEAR = StepCost((1, 65), (0.01, 0.65), 0.0, "linear")  # 10 ms per sequence


# --- prediction ---------------------------------------------------------------------------------
def test_prediction_uses_history_and_falls_back_to_the_batch():
    pred = predict_lengths([[10, 20], [], [40, 40, 100]], "mean")
    assert pred[0] == 15 and pred[2] == 60
    assert pred[1] == np.median([15, 60])
    assert predict_lengths([[3, 9]], "max")[0] == 9
    assert (predict_lengths([[], []]) == 1.0).all()
    with pytest.raises(ValueError, match="length stat"):
        predict_lengths([[1]], "mode")


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2], [5, 5, 9]) == pytest.approx(1.0)


# --- plans ----------------------------------------------------------------------------------------
def test_even_and_least_loaded_plans():
    lengths = [[5.0] * 2 for _ in range(6)]
    even = make_plan("even", lengths, 3, cost=FLAT, max_num_seqs=8)
    assert [[u.prompt for u in w] for w in even.workers] == [[0, 1], [2, 3], [4, 5]]
    ll = make_plan("least_loaded", lengths, 4, cost=FLAT, max_num_seqs=8)
    assert ll.samples_per_worker() == [3, 3, 3, 3]
    assert not even.migrate and not ll.migrate


def test_histopipe_balances_predicted_work_and_alternates_order():
    rng = np.random.default_rng(0)
    per_prompt = np.sort(rng.lognormal(3, 0.7, size=40))  # dataset order happens to put long prompts last
    lengths = [[float(x)] * 4 for x in per_prompt]

    def worst(plan):
        return max(estimate_s(sum(lengths[u.prompt][s] for u in w for s in u.samples),
                              max((lengths[u.prompt][0] for u in w), default=0),
                              sum(len(u.samples) for u in w), LINEAR, 64) for w in plan.workers)

    even = make_plan("even", lengths, 4, cost=LINEAR, max_num_seqs=64)
    hp = make_plan("histopipe", lengths, 4, cost=LINEAR, max_num_seqs=64, step=1)
    assert worst(hp) < 0.8 * worst(even)
    assert worst(make_plan("histopipe", lengths, 4, cost=LINEAR, max_num_seqs=64, placement="lpt")) < 0.8 * worst(even)
    # every sample placed exactly once
    placed = sorted((u.prompt, s) for w in hp.workers for u in w for s in u.samples)
    assert placed == [(p, s) for p in range(40) for s in range(4)]
    # longest group first on odd steps, on the last worker on even steps
    hp2 = make_plan("histopipe", lengths, 4, cost=LINEAR, max_num_seqs=64, step=2)
    top = int(np.argmax(per_prompt))
    assert any(u.prompt == top for u in hp.workers[0]) and any(u.prompt == top for u in hp2.workers[-1])
    # each worker runs its longest work first
    for w in hp.workers:
        firsts = [lengths[u.prompt][0] for u in w]
        assert firsts == sorted(firsts, reverse=True)


@pytest.mark.parametrize("R", [1, 3, 7, 64])
def test_every_plan_places_every_sample_once(R):
    rng = np.random.default_rng(R)
    for cost in (FLAT, LINEAR):
        for step in (1, 2):
            lengths = [rng.integers(1, 60, size=int(rng.integers(1, 6))).astype(float).tolist() for _ in range(23)]
            want = [(p, s) for p in range(23) for s in range(len(lengths[p]))]
            for policy in POLICIES:
                for placement in PLACEMENTS:
                    plan = make_plan(policy, lengths, R, cost=cost, max_num_seqs=8, step=step, prompt_len=5,
                                     placement=placement)
                    assert len(plan.workers) == R
                    if policy not in ("even", "least_loaded"):  # the placement used is named, auto's pick too
                        assert plan.placement in PLACEMENTS and plan.placement != "auto", (policy, placement)
                    got = sorted((u.prompt, s) for w in plan.workers for u in w for s in u.samples)
                    assert got == want, (policy, placement)


def test_the_prompt_oracle_knows_prompts_not_siblings():
    # Its plan is a function of each prompt's lengths as a multiset: dealing them to the
    # siblings in another order changes nothing, while the oracle's plan follows the siblings.
    rng = np.random.default_rng(0)
    lengths = [rng.lognormal(np.log(rng.uniform(20, 400)), 0.5, size=8).tolist() for _ in range(40)]
    shuffled = [rng.permutation(x).tolist() for x in lengths]

    def placed(policy: str, lens: list[list[float]]) -> list[list[tuple[int, tuple[int, ...]]]]:
        plan = make_plan(policy, lens, 6, cost=LINEAR, max_num_seqs=16, prompt_len=5, placement="contiguous")
        return [[(u.prompt, u.samples) for u in w] for w in plan.workers]

    assert placed("prompt_oracle", lengths) == placed("prompt_oracle", shuffled)
    assert placed("oracle", lengths) != placed("oracle", shuffled)


def test_group_time_prices_the_spread_of_a_group():
    # no spread, no error: the estimate is the closed form on the lengths (up to the grid's step)
    d = LengthDists(np.log(np.array([100.0, 400.0])), np.zeros(2), 0.0, 1000.0)
    est = GroupTime(d, np.array([0, 0, 1]), np.array([2, 1]), LINEAR, 64)
    assert est(0, 3) == pytest.approx(estimate_s(600.0, 400.0, 3, LINEAR, 64), rel=0.06)
    assert est(0, 2) == pytest.approx(estimate_s(200.0, 100.0, 2, LINEAR, 64), rel=0.06)
    # a spread raises the priced longest sample, more for more samples (a max), and the error the total
    wide = GroupTime(LengthDists(d.mu, np.full(2, 0.5), 0.0, 1000.0), np.array([0, 0, 1]), np.array([2, 1]), LINEAR, 64)
    assert wide(0, 1) > est(0, 1) and wide(0, 2) > wide(0, 1)
    err = GroupTime(LengthDists(d.mu, np.zeros(2), 0.3, 1000.0), np.array([0, 0, 1]), np.array([2, 1]), LINEAR, 64)
    assert err(0, 3) > est(0, 3)
    # cuts: contiguous, cover everything, never more groups than workers
    bounds = cut_contiguous(est, 3, 2)
    assert bounds[0] == 0 and bounds[-1] == 3 and len(bounds) - 1 <= 2 and bounds == sorted(bounds)


def test_group_time_of_any_run_equals_pricing_its_samples_one_by_one():
    """The prefix sums kept per run of a prompt's samples give, for every cut [a, b) (inside runs
    and across them), the same priced longest sample as multiplying the samples' CDFs one by one."""
    from math import erf, sqrt

    rng = np.random.default_rng(3)
    d = LengthDists(rng.normal(5.0, 0.5, 6), rng.uniform(0.1, 0.6, 6), 0.2, 2000.0)
    up = np.repeat(rng.permutation(6), rng.integers(1, 5, 6))
    est = GroupTime(d, up, np.bincount(up, minlength=6), LINEAR, 4)
    s = d.total_sigma
    z = (np.log(est.grid)[None, :] - d.mu[:, None]) / s[:, None]
    cdf = 0.5 * (1.0 + np.vectorize(erf)(z / sqrt(2.0)))
    cdf[:, -1] = 1.0
    for a in range(len(up)):
        for b in range(a + 1, len(up) + 1):
            log_p = np.log(np.maximum(cdf[up[a:b]], 1e-300)).sum(axis=0)
            assert np.allclose(est._cdf_at(b) - est._cdf_at(a), log_p, atol=1e-9), (a, b)


def test_log_error_sigma():
    assert log_error_sigma([100, 200], [100, 200]) == 0.0
    assert log_error_sigma([100, 100], [100 * np.e, 100 / np.e]) == pytest.approx(1.0)
    assert log_error_sigma([100], [300]) == 0.0  # one prompt says nothing of the spread


def placement_makespans(kind: str, workers: int, names: tuple[str, ...]) -> dict[str, float]:
    """Simulated makespans on a synthetic trace, summed over two workloads of ``workers`` x 16
    prompts: predictions from the previous epoch only, the truth drawn apart from them.
    ``least_loaded`` is the routing policy, the other names HistoPipe's placements."""
    from rhymerl.bench.pipe import MAX_TOKENS, scaled_workload, synthetic_pairs
    from rhymerl.scheduling.length_predictor import predicted_samples

    pairs = synthetic_pairs(kind, 1024, 16, np.random.default_rng(3))
    err = log_error_sigma([np.mean(p) for p, _ in pairs], [np.mean(c) for _, c in pairs])
    total = dict.fromkeys(names, 0.0)
    for seed in (4, 5):
        true, prev = scaled_workload(pairs, workers * 16, 16, 1.0, np.random.default_rng(seed))
        guess = predicted_samples(prev, [16] * len(prev))
        for name in names:
            policy, placement = ("least_loaded", "auto") if name == "least_loaded" else ("histopipe", name)
            plan = make_plan(policy, guess, workers, cost=GPU_8B_H100, max_num_seqs=256, prompt_len=256,
                             placement=placement, error_sigma=err, max_tokens=MAX_TOKENS)
            total[name] += simulate(plan, true, 256, GPU_8B_H100, max_num_seqs=256).makespan_s
    return total


@pytest.mark.parametrize("kind", ["reasoning", "lognormal"])
def test_spread_placement_beats_least_loaded_on_noisy_reasoning_lengths(kind):
    # Reasoning-shaped traces at 128 workers. Pricing each prompt's spread (risky samples
    # together on lightly loaded workers) must beat routing by counts and the paper's
    # point-prediction cut, summed over two workloads (on a single small workload it can tie:
    # bench pipe's rows).
    total = placement_makespans(kind, 128, ("least_loaded", "contiguous", "spread"))
    assert total["spread"] < 0.97 * total["least_loaded"], total
    assert total["spread"] < total["contiguous"], total


@pytest.mark.parametrize("kind", ["reasoning", "lognormal", "heavy_tail"])
def test_stripe_placement_is_never_slower_than_least_loaded(kind):
    # Dealing the samples in snake order by predicted risk balances every risk band across the
    # workers by design; least-loaded routing deals them in arrival order (by chance).
    total = placement_makespans(kind, 64, ("least_loaded", "stripe"))
    assert total["stripe"] < total["least_loaded"], total


def test_streamed_step_model():
    from rhymerl.bench.step_model import streamed_s

    none = [0.0, 0.0]
    # groups done only at the rollout's end: nothing overlaps, the work follows the rollout
    assert streamed_s(1.0, [1.0, 1.0], [0.1, 0.1], none, 0.3, 2.0, 2.0) == pytest.approx(1.5)
    # done early, cores to spare: the work hides in the rollout
    assert streamed_s(1.0, [0.1, 0.2], [0.1, 0.1], none, 0.3, 1.0, 1.0) == pytest.approx(1.3)
    # both twice as slow while they overlap: what is hidden is lost again (two cores, four threads)
    assert streamed_s(1.0, [0.1, 0.2], [0.1, 0.1], none, 0.3, 2.0, 2.0) == pytest.approx(1.5)
    # the work waits for a late group, then runs past the rollout's end
    assert streamed_s(1.0, [0.9], [0.4], [0.0], 0.0, 1.0, 1.0) == pytest.approx(1.3)
    # the first group in order lands last: the second's log-probs run meanwhile, its gradient
    # share (which must follow the first's) only after; in order alone it would all follow (1.5)
    assert streamed_s(1.0, [0.9, 0.1], [0.1, 0.3], [0.0, 0.2], 0.0, 1.0, 1.0) == pytest.approx(1.2)


def test_reasoning_trace_reproduces_its_published_figures():
    # docs/traces.md: RhymeRL's 2-4 % of prompts changing length rank much between epochs, and
    # Seer's last 10 % of requests taking about half of an even-split synchronous rollout.
    from rhymerl.bench.pipe import rank_change_fraction, scaled_workload, synthetic_pairs
    from rhymerl.scheduling import GPU_8B_H100

    pairs = synthetic_pairs("reasoning", 4096, 16, np.random.default_rng(1))
    assert 0.02 <= rank_change_fraction(pairs) <= 0.04
    true, _ = scaled_workload(pairs, 64 * 16, 16, 1.0, np.random.default_rng(0))
    r = simulate(make_plan("even", true, 64, cost=GPU_8B_H100, max_num_seqs=256), true, 256, GPU_8B_H100,
                 max_num_seqs=256)
    assert 0.4 <= r.tail_share <= 0.6


# --- simulator --------------------------------------------------------------------------------
def test_simulator_matches_hand_computation():
    # one worker, 1 s per step: samples of 3 and 5 tokens run together -> 5 steps
    plan = make_plan("even", [[3, 5]], 1, cost=FLAT, max_num_seqs=4)
    r = simulate(plan, [[3, 5]], 0, FLAT, max_num_seqs=4)
    assert r.makespan_s == pytest.approx(5.0) and r.bubble_fraction == pytest.approx(0.0)
    # one slot: they run one after the other -> 8 steps
    assert simulate(plan, [[3, 5]], 0, FLAT, max_num_seqs=1).makespan_s == pytest.approx(8.0)
    # two workers, even split of [10] and [2]: worker 1 idles 8 of 10 s -> bubble 0.4
    plan2 = make_plan("even", [[10], [2]], 2, cost=FLAT, max_num_seqs=4)
    r2 = simulate(plan2, [[10], [2]], 0, FLAT, max_num_seqs=4)
    assert r2.makespan_s == pytest.approx(10.0) and r2.bubble_fraction == pytest.approx(0.4)


def test_compiled_simulator_equals_its_python_reference():
    """The compiled event loop and the Python reference give the same results to the bit, with
    and without tail migration and stealing, on shared cores and own devices."""
    from rhymerl.scheduling import simulator as S

    if S._core is None:
        pytest.skip("the compiled simulator core is not built (pip install -e .)")
    rng = np.random.default_rng(0)
    costs = [GPU_8B_H100, StepCost((1, 4, 16, 64), (1.0, 1.3, 2.0, 5.0), 0.01), StepCost((1, 2), (1.0, 1.0), 0.5),
             StepCost((2, 8, 32), (0.5, 0.9, 3.0), 0.002)]
    moved = stolen = 0
    for trial in range(60):
        R, P, n = int(rng.integers(1, 12)), int(rng.integers(1, 40)), int(rng.integers(1, 9))
        true = [rng.lognormal(np.log(rng.uniform(5, 200)), rng.uniform(0.05, 1.2), size=n).astype(int).clip(1).tolist()
                for _ in range(P)]
        prev = [rng.lognormal(np.log(np.mean(t) + 1), 0.3, size=n).tolist() for t in true]
        policy = ("even", "least_loaded", "histopipe", "oracle")[trial % 4]
        cost, mns = costs[trial % len(costs)], int(rng.integers(1, 64))
        plan = make_plan(policy, true if policy == "oracle" else predicted_samples(prev, [n] * P), R, cost=cost,
                         max_num_seqs=mns, prompt_len=10.0, step=trial, error_sigma=0.2, max_tokens=4000)
        plan.migrate = plan.migrate or bool(trial % 2)
        kw = dict(max_num_seqs=mns, tail_fraction=float(rng.choice([0.1, 0.5, 1.0])))
        if trial % 3 == 0:
            kw.update(cores=2.0, threads=1, contention=1.1)
        args = (plan, true, int(rng.integers(0, 30)), cost)
        a = S.simulate(*args, **kw)
        core, S._core = S._core, None
        try:
            b = S.simulate(*args, **kw)
        finally:
            S._core = core
        assert (a.makespan_s, a.busy_s, a.prompt_done_s, a.migrations, a.steals, a.tail_share) == \
            (b.makespan_s, b.busy_s, b.prompt_done_s, b.migrations, b.steals, b.tail_share), trial
        moved += a.migrations > 0
        stolen += a.steals > 0
    assert moved and stolen  # both run-time moves were exercised


def test_simulator_shares_cores_between_busy_workers():
    # 4 workers on 2 cores, 1 thread each: 2x slower while all 4 are busy (2 s of their own time),
    # full speed once two are done -> 2 * 2 + 8 = 12 s; busy 12, 12, 4, 4 of 4 x 12
    lens = [[10], [10], [2], [2]]
    plan = make_plan("even", lens, 4, cost=FLAT, max_num_seqs=4)
    alone = simulate(plan, lens, 0, FLAT, max_num_seqs=4)
    shared = simulate(plan, lens, 0, FLAT, max_num_seqs=4, cores=2, threads=1)
    assert alone.makespan_s == pytest.approx(10.0)
    assert shared.makespan_s == pytest.approx(12.0) and shared.bubble_fraction == pytest.approx(1 / 3)
    # enough cores for everyone: nothing changes
    assert simulate(plan, lens, 0, FLAT, max_num_seqs=4, cores=4).makespan_s == pytest.approx(10.0)


def test_simulator_tail_migration_helps_when_steps_cost_more_at_larger_batch():
    # worker 0's samples all run far longer than predicted; worker 1 finishes early and takes one
    lengths = [[200] + [100] * 7, [10] * 8]
    workers = [[WorkUnit(0, tuple(range(8)))], [WorkUnit(1, tuple(range(8)))]]
    plan = Plan("histopipe", workers, migrate=True)
    no = simulate(Plan("histopipe", workers, migrate=False), lengths, 4, LINEAR, max_num_seqs=8,
                  predicted=np.array([10.0, 10.0]))
    yes = simulate(plan, lengths, 4, LINEAR, max_num_seqs=8, predicted=np.array([10.0, 10.0]), tail_fraction=0.5)
    assert yes.migrations >= 1
    assert yes.makespan_s < no.makespan_s


def test_simulator_scales():
    rng = np.random.default_rng(0)
    lengths = [rng.integers(10, 2000, size=8).tolist() for _ in range(2048)]
    plan = make_plan("least_loaded", lengths, 128, cost=LINEAR, max_num_seqs=64)
    r = simulate(plan, lengths, 100, LINEAR, max_num_seqs=64)
    assert r.tokens == sum(map(sum, lengths)) and r.makespan_s > 0


# --- coordinator and workers ----------------------------------------------------------------------
def _requests(n_prompts: int = 10, n: int = 4, max_tokens: int = 40) -> list[RolloutRequest]:
    rng = np.random.default_rng(1)
    reqs = []
    for i in range(n_prompts):
        prompt = rng.integers(3, 40, size=int(rng.integers(3, 10))).tolist()
        reqs.append(RolloutRequest(prompt, SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens), 1000 + i,
                                   f"p{i}"))
    return reqs


def _reference(model_dir: str, reqs: list[RolloutRequest]) -> list[list[list[int]]]:
    llm = LLM(model_dir, max_num_seqs=64, max_model_len=64)
    params = [SamplingParams(n=r.params.n, temperature=1.0, max_tokens=r.params.max_tokens, seed=r.seed) for r in reqs]
    return [[c.token_ids for c in o.outputs] for o in llm.generate([r.prompt_ids for r in reqs], params,
                                                                    use_tqdm=False)]



def _specs(model_dir: str, k: int, spec=None) -> list[WorkerSpec]:
    return [WorkerSpec(model_dir, max_num_seqs=16, max_model_len=64, speculative=spec) for _ in range(k)]


@pytest.mark.parametrize("policy", ["even", "least_loaded", "histopipe"])
def test_workers_emit_the_tokens_of_one_engine(model_dir, policy):
    from rhymerl.model import load_pretrained

    reqs = _requests()
    ref = _reference(model_dir, reqs)
    named = dict(load_pretrained(model_dir).named_parameters())
    # The gate off: drafts are made whatever the machine's speed (under load the gate may rightly
    # decline them all, and this test is about the history reaching the workers).
    pool = InprocPool(_specs(model_dir, 3, {"method": "history", "gate": False}))
    pool.update_weights(named)
    co = RolloutCoordinator(pool, policy=policy, history=HistoryStore(), max_num_seqs=16, slice_s=0.002)
    streamed = []
    for step in (1, 2):
        outs = co.rollout(reqs, step, on_done=lambda i, o: streamed.append(i))
        assert tokens_of(outs) == ref
        for r, o in zip(reqs, outs):  # as the training loop records them
            co.history.add(r.prompt_key, r.prompt_ids, [c.token_ids for c in o.outputs], step)
    assert sorted(streamed) == sorted(list(range(len(reqs))) * 2)
    assert co.stats.accepted > 0  # step 2 drafted from step 1's history, shipped to the workers
    if policy == "histopipe":  # step 2 was planned from history: the simulator was checked against the workers
        assert co.placements.steps == 1 and co.placements.share_error_sq is not None
    assert all(len(co.history.lengths(r.prompt_key)) == 4 for r in reqs)


def test_scoring_a_steps_placements_waits_for_no_one_but_the_next_plan(model_dir, monkeypatch):
    """After a HistoPipe step the coordinator scores every placement on the actual lengths: that
    runs beside what comes next (training, the next rollout), and the next plan waits for it."""
    import threading

    from rhymerl.model import load_pretrained
    from rhymerl.scheduling.placement_scores import PlacementScores

    release, scored = threading.Event(), []
    real = PlacementScores.observe

    def slow_observe(self, *a, **kw):
        release.wait(30)  # held until the test has seen rollout return
        scored.append(threading.current_thread().name)
        return real(self, *a, **kw)

    monkeypatch.setattr(PlacementScores, "observe", slow_observe)
    reqs = _requests()
    pool = InprocPool(_specs(model_dir, 2))
    pool.update_weights(dict(load_pretrained(model_dir).named_parameters()))
    store = HistoryStore()
    for r in reqs:
        store.add(r.prompt_key, r.prompt_ids, [[5] * 8], step=0)
    co = RolloutCoordinator(pool, policy="histopipe", history=store, cost=LINEAR, max_num_seqs=16, slice_s=0.002)
    co.rollout(reqs, 1)
    assert scored == []  # rollout returned with the scoring still held
    release.set()
    co.plan(reqs, 2)  # waits for it
    assert len(scored) == 1 and scored[0] != threading.current_thread().name
    assert co.placements.steps == 1 and co.placements.share_error_sq is not None


def test_a_worker_reports_each_whole_group_at_once(model_dir):
    """For a streamed update: with ``report_finished`` a slice ends when a group is whole (here
    slices are otherwise longer than the rollout), the same tokens."""
    from rhymerl.model import load_pretrained

    reqs = _requests()
    ref = _reference(model_dir, reqs)
    pool = InprocPool([WorkerSpec(model_dir, max_num_seqs=16, max_model_len=64)])
    pool.update_weights(dict(load_pretrained(model_dir).named_parameters()))
    co = RolloutCoordinator(pool, policy="even", max_num_seqs=16, slice_s=60.0, report_finished=True)
    reports: list[int] = []
    co.on_report = lambda h, rep: reports.append(len(rep.finished))
    done: list[int] = []
    outs = co.rollout(reqs, 1, on_done=lambda i, o: done.append(i))
    assert tokens_of(outs) == ref and sorted(done) == list(range(len(reqs)))
    assert len(reports) > 1 and all(n > 0 for n in reports)  # every slice ended on a whole group


def test_migration_and_stealing_keep_the_tokens(model_dir):
    from rhymerl.model import load_pretrained

    reqs = _requests(n_prompts=6, max_tokens=48)
    ref = _reference(model_dir, reqs)
    pool = InprocPool(_specs(model_dir, 2))
    pool.update_weights(dict(load_pretrained(model_dir).named_parameters()))
    # everything predicted tiny and a steep cost curve: moving work to the idle worker always pays
    store = HistoryStore()
    for r in reqs:
        store.add(r.prompt_key, r.prompt_ids, [[5]], step=0)
    co = RolloutCoordinator(pool, policy="histopipe", history=store, cost=LINEAR, max_num_seqs=16,
                            tail_fraction=1.0, slice_s=0.0, placement="lpt")  # a placement that migrates
    plan = co.plan(reqs, 1)
    plan.workers = [[u for w in plan.workers for u in w], []]  # all work on worker 0: worker 1 must take some
    outs = co.rollout(reqs, 1, plan=plan)
    assert tokens_of(outs) == ref
    assert co.pipe.steals > 0 and co.pipe.migrations > 0


def test_paused_samples_continue_to_the_tokens_of_an_uninterrupted_run(model_dir):
    """Partial rollouts: samples paused at a token budget and continued from their prefix (same
    weights here) end with the tokens they would have had; finished siblings are kept."""
    from rhymerl.model import load_pretrained
    from rhymerl.training.rollout.partial import CarriedGroup, merge, paused_samples, step_budget

    reqs = _requests(n_prompts=6, max_tokens=40)
    ref = _reference(model_dir, reqs)
    pool = InprocPool(_specs(model_dir, 2))
    pool.update_weights(dict(load_pretrained(model_dir).named_parameters()))
    co = RolloutCoordinator(pool, policy="least_loaded", max_num_seqs=16, slice_s=0.002)
    budget = 8

    def first_part(r: RolloutRequest) -> RolloutRequest:
        p = SamplingParams(n=r.params.n, temperature=1.0, max_tokens=step_budget(40, budget), logprobs=True)
        return RolloutRequest(r.prompt_ids, p, r.seed, r.prompt_key)

    outs = co.rollout([first_part(r) for r in reqs], 1)
    groups = []
    for r, o in zip(reqs, outs):
        paused = {c.index: (c.token_ids, c.logprobs) for c in paused_samples(o, 40)}
        groups.append(CarriedGroup(r.prompt_key, r.seed, 1, [c for c in o.outputs if c.index not in paused], paused))
    assert sum(len(g.paused) for g in groups) > 0 and sum(len(g.finished) for g in groups) > 0
    assert all(len(t) == budget for g in groups for t, _ in g.paused.values())
    again = [g for g in groups if g.paused]
    g2 = [CarriedGroup.from_dict(g.to_dict()) for g in again]  # as a checkpoint keeps them
    cont = [RolloutRequest(r.prompt_ids, SamplingParams(n=r.params.n, temperature=1.0, max_tokens=40, logprobs=True),
                           g.seed, g.key, samples=tuple(sorted(g.paused)), prefixes=dict(g.paused))
            for g in g2 for r in reqs if r.prompt_key == g.key]
    merged = {g.key: merge(g, o) for g, o in zip(g2, co.rollout(cont, 2))}
    final = [merged.get(r.prompt_key) or RequestOutput(0, r.prompt_ids, g.finished)
             for r, g in zip(reqs, groups)]
    assert tokens_of(final) == ref


def _pids(pool, backend: str) -> list[int]:
    if backend == "local":
        return [h.proc.pid for h in pool.handles]
    import ray

    return ray.get([h.actor.ping.remote() for h in pool.handles])


def _signal_once(pid: int, sig: int, sent: list[int], index: int = 1):
    """A coordinator hook that sends ``sig`` to worker ``index`` (process ``pid``) once it is mid-work."""

    def hook(h, rep):
        if h.index == index and not sent and (rep.running or rep.waiting):
            os.kill(pid, sig)
            sent.append(sig)

    return hook


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "ray"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_lost_workers_are_replaced_without_changing_tokens(model_dir, sig, backend):
    """A killed worker, or one that stops answering (past worker_timeout_s): its unfinished
    samples re-run on the other worker with the same seeds, so the step's tokens are unchanged."""
    from rhymerl.model import load_pretrained

    if backend == "ray":
        pytest.importorskip("ray")
    reqs = _requests(n_prompts=8, max_tokens=48)
    ref = _reference(model_dir, reqs)
    named = dict(load_pretrained(model_dir).named_parameters())
    pool = make_pool(backend, _specs(model_dir, 2, {"method": "history"}), named)
    pids = _pids(pool, backend)
    try:
        co = RolloutCoordinator(pool, policy="even", history=HistoryStore(), max_num_seqs=16, slice_s=0.01,
                                worker_timeout_s=3.0)
        sent: list[int] = []
        co.on_report = _signal_once(pids[1], sig, sent)
        assert tokens_of(co.rollout(reqs, 1)) == ref
        assert sent and co.pipe.lost_workers == 1 and co.pipe.rerun_samples > 0
        assert [h.index for h in pool.alive()] == [0]
        assert tokens_of(co.rollout(reqs, 1)) == ref  # the next step runs on the survivor
    finally:
        pool.close()
        for pid in pids:  # a stopped process the pool could not reap
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if backend == "ray":
            import ray

            ray.shutdown()  # its raylet's reports of the killed worker would outlive the test run


def test_step_model_projection_rows():
    """The whole-step model: speculation shortens rollout, HistoPipe lowers the rollout bubble,
    async overlaps rollout with training; a small cluster keeps the test fast."""
    from dataclasses import replace

    from rhymerl.bench.step_model import SCALES, Lengths, project, step_time

    small = replace(SCALES["8b_32gpu"], gpus=8, prompts=32, n=8, lengths=Lengths(median=1500, max_len=4096))
    rows = {r["variant"]: r for r in project(small)}
    assert rows["baseline"]["speedup"] == 1.0
    assert rows["+histospec"]["rollout_s"] < rows["baseline"]["rollout_s"]
    assert rows["+histopipe"]["bubble_fraction"] < rows["baseline"]["bubble_fraction"]
    assert rows["+async"]["step_s"] < rows["baseline"]["rollout_s"] + rows["baseline"]["train_s"]
    for r in rows.values():
        assert 0 <= r["bubble_fraction"] < 1 and 0 < r["rollout_share"] <= 1
    # speculation that accepts nothing more than it drafts only costs
    assert step_time(small, spec="histospec", accept=1.01).rollout_s > rows["baseline"]["rollout_s"]
    # a model drafter pays its draft forwards on the GPU: at history's acceptance it is slower
    # than history's free drafts, and the bigger drafter the slower
    same = replace(small, accept_model=small.accept_histospec)
    spec = {m: step_time(same, spec=m).rollout_s for m in ("histospec", "draft_head", "draft_model")}
    assert spec["histospec"] < spec["draft_head"] < spec["draft_model"] < rows["baseline"]["rollout_s"]
    assert rows["+hybrid"]["rollout_s"] < rows["+draft_head"]["rollout_s"]
    with pytest.raises(KeyError, match="valid: none, histospec"):
        step_time(small, spec="eagle9")


def test_simulated_workers_slow_each_other_by_the_measured_contention():
    # two one-thread workers on two cores: no shared core, but a measured slow-down while both run
    cost = StepCost((1, 64), (0.01, 0.01), 0.0, "flat")
    true = [[100] * 4, [100] * 4]
    plan = make_plan("even", true, 2, cost=cost, max_num_seqs=8)
    alone = simulate(plan, true, 1, cost, max_num_seqs=8, cores=2, threads=1)
    both = simulate(plan, true, 1, cost, max_num_seqs=8, cores=2, threads=1, contention=1.25)
    assert both.makespan_s == pytest.approx(1.25 * alone.makespan_s)


def test_calibrations_average_term_by_term_and_learning_differences_are_relative():
    from rhymerl.bench.calibrate import mean_costs
    from rhymerl.bench.e2e import max_rel_diff
    from rhymerl.bench.step_model import LocalCosts

    a = LocalCosts(StepCost((1, 2), (1.0, 2.0), 0.1), StepCost((1, 2), (1.0, 2.0)), 1e-4, 2, 2,
                   logp_share=0.2, engine_pair_slowdown=1.0, beside_rest=(1.5, 3.0), rest_alone=1.6,
                   history_draft_s_per_row=4e-5)
    b = LocalCosts(StepCost((1, 2), (3.0, 4.0), 0.3), StepCost((1, 2), (1.0, 2.0)), 3e-4, 2, 2,
                   logp_share=0.4, engine_pair_slowdown=1.2, beside_rest=(2.5, 4.0), rest_alone=1.8,
                   history_draft_s_per_row=6e-5)
    m = mean_costs(a, b)
    assert m.engine.seconds == (2.0, 3.0) and m.engine.prefill_per_token_s == pytest.approx(0.2)
    assert m.train_s_per_token == pytest.approx(2e-4) and m.cores == 2
    assert m.rest_slowdowns(1) == pytest.approx((2.0, 3.5, 1.7))
    assert m.engine_pair_slowdown == pytest.approx(1.1) and m.history_draft_s_per_row == pytest.approx(5e-5)
    # not measured side by side: the thread-count rule (2 cores, a 1-thread worker, the 2-thread
    # trainer on the one core left: twice as slow, beside the worker and after it)
    bare = LocalCosts(StepCost((1, 2), (1.0, 2.0)), StepCost((1, 2), (1.0, 2.0)), 1e-4, 2, 2)
    assert bare.rest_slowdowns(1) == (1.0, 2.0, 2.0)

    assert max_rel_diff([{"x": 1.0, "y": 2}], [{"x": 1.0, "y": 2}]) == 0.0
    assert max_rel_diff([{"x": 1.0}], [{"x": 1.1}]) == pytest.approx(0.1 / 1.1)
    assert max_rel_diff([{"x": 1.0}], []) == float("inf")


def test_synthetic_trace_knows_what_its_next_epoch_was_drawn_from():
    # dist_oracle plans from each prompt's true distribution: its quantiles must be those the
    # next epoch's samples were drawn from, and only synthetic traces (which have one) get the row.
    from statistics import NormalDist

    from rhymerl.bench.pipe import SimSource, simulated_rows, synthetic_trace
    from rhymerl.scheduling import GPU_8B_H100

    tr = synthetic_trace("lognormal", 512, 16, np.random.default_rng(5))
    logs = np.log([c for _, c in tr.pairs]) - np.log(tr.medians)[:, None]
    assert abs(logs.mean()) < 0.02 and abs(logs.std() - tr.spread) < 0.02
    q = tr.quantiles(0, 16)
    assert q == sorted(q) and np.sqrt(q[7] * q[8]) == pytest.approx(tr.medians[0], rel=1e-6)
    assert np.log(q[-1] / q[0]) == pytest.approx(2 * tr.spread * NormalDist().inv_cdf(15.5 / 16))
    rows = simulated_rows({"with": SimSource(tr.pairs, 1.0, GPU_8B_H100, 256.0, 32768.0, tr),
                           "without": SimSource(tr.pairs, 1.0, GPU_8B_H100, 256.0, 32768.0)}, [4])
    assert {r["trace"] for r in rows if r["policy"] == "dist_oracle"} == {"with"}
    assert {r["trace"] for r in rows if r["policy"] == "history_oracle"} == {"with"}
    # history_oracle: the previous epoch's distribution, which the previous lengths were drawn from
    logs = np.log([p for p, _ in tr.pairs]) - np.log(tr.previous_medians)[:, None]
    assert abs(logs.mean()) < 0.02 and abs(logs.std() - tr.spread) < 0.02
    assert tr.quantiles(0, 16, previous=True)[8] / tr.quantiles(0, 16)[8] == \
        pytest.approx(tr.previous_medians[0] / tr.medians[0], rel=1e-6)
    assert all(r["vs_oracle"] > 0 for r in rows)

def test_bench_orders_balance_positions_and_predecessors_and_intervals_pair_steps():
    from collections import Counter

    import numpy as np

    from rhymerl.bench.common import bootstrap_interval
    from rhymerl.bench.e2e import balanced_orders

    for n in (2, 3, 5, 8):
        orders = balanced_orders(n)
        assert all(sorted(o) == list(range(n)) for o in orders)
        follows = Counter((o[i], o[i + 1]) for o in orders for i in range(n - 1))
        first = Counter(o[0] for o in orders)
        assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1  # every ordered pair, equally
        assert len(first) == n and len(set(first.values())) == 1
    # paired steps that move together (drift) pin a ratio down; the same values unpaired do not
    steps = np.linspace(1.0, 3.0, 24)
    paired = np.column_stack([steps, steps / 1.1])
    lo, hi = map(float, bootstrap_interval(paired, lambda s: s[:, 0].sum() / s[:, 1].sum()).split("-"))
    assert lo == hi == pytest.approx(1.1, abs=1e-3)
    shuffled = np.column_stack([steps, np.random.default_rng(1).permutation(steps) / 1.1])
    lo, hi = map(float, bootstrap_interval(shuffled, lambda s: s[:, 0].sum() / s[:, 1].sum()).split("-"))
    assert lo < 1.05 and hi > 1.15


def _rhyming_pairs(count: int, n: int, rng: np.random.Generator) -> list:
    """A trace like the built-in task's: each prompt's typical length predicts its next epoch
    almost perfectly (rank correlation ~0.98), while its samples vary around it."""
    typical = rng.lognormal(np.log(30), 0.35, size=count)
    draw = lambda t: np.maximum(4, rng.lognormal(np.log(t)[:, None], 0.3, size=(count, n))).astype(int).tolist()
    return list(zip(draw(typical), draw(typical * rng.lognormal(0, 0.03, size=count))))


def test_a_placement_reading_predictions_must_beat_the_better_knowledge_free_deal():
    """Least-loaded's deal is where HistoPipe starts; even split's (siblings together) replaces it
    when it finished first or too close to call, and a placement that reads the predictions is
    used only when it finished clearly faster than the better of the two."""
    from rhymerl.scheduling.placement_scores import PlacementScores

    learnt = PlacementScores(scores={"least_loaded+static": 1.03, "even+static": 1.0, "spread+migrate": 0.99})
    assert learnt.choose() == ("even", False)
    learnt.scores["spread+migrate"] = 0.97
    assert learnt.choose() == ("spread", True)
    learnt.scores["even+static"] = 1.05
    assert learnt.choose() == ("spread", True)
    learnt.scores["spread+migrate"] = 1.02
    assert learnt.choose() == ("least_loaded", False)
    learnt.scores["even+static"] = 1.04  # too close to call (the 2 % margin): siblings together
    assert learnt.choose() == ("even", False)


def test_a_placement_must_beat_the_knowledge_free_deal_by_more_than_the_simulators_measured_error():
    """Where the simulator misprices one worker's share against another's by more than a
    placement's predicted gain, the knowledge-free deal is kept; a machine-wide drift (every
    share off by the same factor) is no such error."""
    from rhymerl.scheduling.placement_scores import PlacementScores

    scores = {"least_loaded+static": 1.0, "even+static": 1.10, "spread+migrate": 0.96}
    learnt = PlacementScores(scores=dict(scores))
    assert learnt.choose() == ("spread", True)  # 4 % ahead, no measured error yet: the default margin
    assert learnt.observe_shares([2.0, 2.2, 1.8], [1.0, 1.1, 0.9]) == pytest.approx(0.0)  # drift only
    assert learnt.choose() == ("spread", True)
    spread = learnt.observe_shares([1.0, 1.12], [1.0, 1.0])  # one share 12 % dearer than priced
    assert spread == pytest.approx(0.0801, abs=1e-3) and learnt.share_error > 0.04
    assert learnt.choose() == ("least_loaded", False)
    assert learnt.observe_shares([1.0, 0.0], [1.0, 1.0]) is None  # an idle worker says nothing


@pytest.mark.parametrize("kind", ["uninformative", "rhyming", "reasoning", "heavy_tail"])
def test_histopipe_is_never_behind_least_loaded(kind):
    """HistoPipe's placement as the coordinator chooses it (learnt from earlier steps' actual
    lengths, then tail migration) against least-loaded routing, 64 workers, on a step it has not
    seen: never slower, whether predictions carry no information (each prompt predicted from
    another prompt's history), rhyme almost perfectly, or are noisy."""
    from rhymerl.bench.pipe import MAX_TOKENS, scaled_workload, synthetic_pairs
    from rhymerl.scheduling.length_predictor import predicted_samples
    from rhymerl.scheduling.placement_scores import PlacementScores

    rng = np.random.default_rng(3)
    scale = 64.0 if kind in ("rhyming", "uninformative") else 1.0
    pairs = _rhyming_pairs(1024, 16, rng) if scale > 1 else synthetic_pairs(kind, 1024, 16, rng)
    if kind == "uninformative":
        prevs = [p for p, _ in pairs]
        pairs = [(prevs[i], c) for i, (_, c) in zip(rng.permutation(len(pairs)), pairs)]
    err = log_error_sigma([np.mean(p) for p, _ in pairs], [np.mean(c) for _, c in pairs])
    kw = dict(cost=GPU_8B_H100, max_num_seqs=256, prompt_len=256, error_sigma=err, max_tokens=MAX_TOKENS)

    def step(seed):
        true, prev = scaled_workload(pairs, 64 * 16, 16, scale, np.random.default_rng(seed))
        return true, predicted_samples(prev, [16] * len(prev))

    learnt = PlacementScores()
    assert learnt.choose() == ("least_loaded", False)  # before any step
    for seed in (10, 11):
        true, guess = step(seed)
        learnt.observe(guess, true, 64, **kw)
    total = {"least_loaded": 0.0, "histopipe": 0.0}
    for seed in (4, 5):
        true, guess = step(seed)
        for policy in total:
            placement, migrate = learnt.choose()
            plan = make_plan(policy, guess, 64, placement=placement, migrate=migrate, **kw)
            total[policy] += simulate(plan, true, 256, GPU_8B_H100, max_num_seqs=256).makespan_s
    assert total["histopipe"] <= total["least_loaded"], (total, learnt.scores)


def test_each_group_ends_where_its_budget_runs_out_whatever_the_last_groups_size():
    """The budget cut's galloping search (from the last group's size, outward) ends every group
    where a scan from its start would: at the last unit that keeps it within budget."""
    from rhymerl.scheduling.length_risk import cut_at_budget

    rng = np.random.default_rng(5)
    for trial in range(40):
        w = rng.lognormal(0.0, 1.5, size=int(rng.integers(1, 400)))  # groups of very different sizes
        c = np.concatenate([[0.0], np.cumsum(w)])

        def est(a: int, b: int) -> float:
            return float(c[b] - c[a] + 3.0 * w[a:b].max())

        budget = float(rng.uniform(w.max() * 4, c[-1] + 4 * w.max()))
        want, a = [0], 0
        while a < len(w):
            b = a + 1
            while b < len(w) and est(a, b + 1) <= budget:
                b += 1
            want.append(b)
            a = b
        assert cut_at_budget(est, len(w), len(w), budget) == want, trial
        assert cut_at_budget(est, len(w), len(want) - 2, budget) is None  # a worker short
