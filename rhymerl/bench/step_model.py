"""A whole RL step on a GPU cluster, modelled: rollout (HistoPipe's plans replayed by the
discrete-event simulator, speculation as fewer and costlier verification steps), old
log-probs, the update, weight sync; synchronous (colocated) or async (rollout and training
on separate GPUs, overlapped).

This is a model, not a measurement: every constant is a named assumption (``docs/projection.md``
lists them beside the public figures they come from), and ``rhymerl bench project`` prints
how the projected speed-ups move when the least certain of them do.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rhymerl.scheduling.cost import StepCost
from rhymerl.scheduling.length_predictor import log_error_sigma, predicted_samples
from rhymerl.scheduling.planner import make_plan
from rhymerl.scheduling.simulator import simulate


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float  # dense bf16, per second
    hbm_bytes_s: float  # memory bandwidth, per second
    mem_eff: float = 0.85  # achieved fraction of the bandwidth in decode
    compute_eff: float = 0.5  # achieved fraction of the peak in decode and prefill matmuls
    train_mfu: float = 0.35  # model FLOPs utilisation of the update


H100 = GPU("H100 SXM", 989e12, 3.35e12)


@dataclass(frozen=True)
class ModelShape:
    name: str
    total_params: float
    active_params: float  # per token (a mixture of experts activates a few experts)
    kv_bytes_per_token: float  # bf16 K and V of every layer


DENSE_8B = ModelShape("dense 8B (Llama-3.1-8B shape)", 8.03e9, 8.03e9, 32 * 8 * 128 * 2 * 2)
MOE_235B = ModelShape("MoE 235B-A22B (Qwen3-235B-A22B shape)", 235e9, 22e9, 94 * 4 * 128 * 2 * 2)
# Model drafters, run on the target engine's GPUs (docs/projection.md): a small model of the same
# family, and an Eagle-style head (one decoder layer; the target's LM head read again per draft)
DRAFT_1B = ModelShape("draft model (Llama-3.2-1B shape)", 1.24e9, 1.24e9, 16 * 8 * 64 * 2 * 2)
DRAFT_1_7B = ModelShape("draft model (Qwen3-1.7B shape)", 1.7e9, 1.7e9, 28 * 8 * 128 * 2 * 2)
HEAD_8B = ModelShape("draft head (1 layer + LM head, 8B)", 0.218e9 + 0.525e9, 0.218e9 + 0.525e9, 8 * 128 * 2 * 2)
HEAD_235B = ModelShape("draft head (1 dense layer + LM head, 235B)", 0.222e9 + 0.622e9, 0.222e9 + 0.622e9,
                       4 * 128 * 2 * 2)


@dataclass(frozen=True)
class Lengths:
    """Reasoning-RL response lengths: each prompt a typical length (lognormal across prompts,
    ``sigma`` the tail), its samples scattered around it (``spread``), the next epoch's typical
    length drifted a little (``drift``); clipped at the context limit."""

    median: float = 3000.0
    sigma: float = 0.8
    spread: float = 0.35
    drift: float = 0.15
    max_len: int = 8192
    prompt_len: int = 512

    def draw(self, prompts: int, n: int, rng: np.random.Generator) -> tuple[list[list[int]], list[list[int]]]:
        """(previous epoch's lengths, this epoch's) per prompt and sample."""
        typical = rng.lognormal(np.log(self.median), self.sigma, size=prompts)

        def epoch(t: np.ndarray) -> list[list[int]]:
            x = rng.lognormal(np.log(t)[:, None], self.spread, size=(prompts, n))
            return np.clip(x, 16, self.max_len).astype(int).tolist()

        return epoch(typical), epoch(typical * rng.lognormal(0.0, self.drift, size=prompts))


@dataclass(frozen=True)
class Scale:
    """A cluster and its RL step."""

    name: str
    model: ModelShape
    gpus: int
    engine_gpus: int  # GPUs per rollout engine (tensor / expert parallel)
    prompts: int
    n: int
    lengths: Lengths
    gpu: GPU = H100
    max_num_seqs: int = 256
    sync_bytes_s: float = 50e9  # weights from the trainer to the engines, effective
    accept_histospec: float = 2.5  # tokens per verification forward, drafts from history
    draft_tokens: int = 4  # drafted tokens scored per row in a verification forward
    ppo_mini_batches: int = 2  # optimizer steps per rollout; the first one can stream (trainer.stream_update)
    draft_model: ModelShape = DRAFT_1B
    draft_head: ModelShape = HEAD_8B
    accept_model: float = 2.25  # tokens per verification forward, model drafts (NeMo-RL: 2.05-2.47)
    hybrid_gain: float = 1.17  # the hybrid's tokens per forward over history alone (docs/results.md)


def speculation(scale: Scale, method: str) -> tuple[float, ModelShape | None]:
    """(tokens per verification forward, the model whose ``draft_tokens`` forwards precede each
    verification on the engine's GPUs; None: drafts cost the GPU nothing) of ``method``."""
    if method not in SPEC_METHODS:
        raise KeyError(f"unknown speculation method {method!r}; valid: {', '.join(SPEC_METHODS)}")
    return SPEC_METHODS[method](scale)


# A method of speculation is one line: its acceptance and what drafts on the GPU.
SPEC_METHODS = {
    "none": lambda s: (1.0, None),
    "histospec": lambda s: (s.accept_histospec, None),  # CPU lookups, overlapped
    "draft_model": lambda s: (s.accept_model, s.draft_model),
    "draft_head": lambda s: (s.accept_model, s.draft_head),
    # per request the better of history and the head: the head runs for every row to be compared
    "hybrid": lambda s: (s.accept_histospec * s.hybrid_gain, s.draft_head),
}


SCALES = {
    "8b_32gpu": Scale("dense 8B, 32 H100", DENSE_8B, 32, 1, 256, 16, Lengths(max_len=8192)),
    "235b_256gpu": Scale("MoE 235B-A22B, 256 H100", MOE_235B, 256, 16, 256, 16,
                         Lengths(median=6000, max_len=32768, prompt_len=1024), draft_model=DRAFT_1_7B,
                         draft_head=HEAD_235B),
}


def engine_cost(scale: Scale, engine_gpus: int, *, scored: float = 1.0, avg_context: float = 0.0,
                drafter: ModelShape | None = None) -> StepCost:
    """One engine's decode (or verification) step time against its batch size: the weights read
    once per step (for a mixture of experts at these batches, nearly every expert is hit), plus
    per sequence its KV cache and its ``scored`` tokens' matmuls; with a ``drafter``, its
    ``draft_tokens`` draft forwards (one token per row each) before the verification."""
    g = scale.gpu
    bw = engine_gpus * g.hbm_bytes_s * g.mem_eff
    flops = engine_gpus * g.peak_flops * g.compute_eff

    def forward(m: ModelShape, tokens: float) -> tuple[float, float]:  # (per step, per row)
        return (2.0 * m.total_params / bw,
                avg_context * m.kv_bytes_per_token / bw + tokens * 2.0 * m.active_params / flops)

    base, per_seq = forward(scale.model, scored)
    if drafter is not None:
        d_base, d_seq = forward(drafter, 1.0)
        base, per_seq = base + scale.draft_tokens * d_base, per_seq + scale.draft_tokens * d_seq
    batches = (1, 64, 128, 256)
    prefill = 2.0 * scale.model.active_params / flops
    return StepCost(batches, tuple(base + per_seq * b for b in batches), prefill,
                    f"{scale.model.name} on {engine_gpus} {g.name} (modelled)")


@dataclass
class StepTime:
    step_s: float
    rollout_s: float
    train_s: float  # old log-probs + update
    sync_s: float
    bubble_fraction: float  # idle GPU-time over the step's GPU-time

    @property
    def rollout_share(self) -> float:
        return self.rollout_s / self.step_s


def rollout_time(scale: Scale, true: list[list[int]], prev: list[list[int]], engines: int, *,
                 histopipe: bool, accept: float, step: int = 1,
                 drafter: ModelShape | None = None) -> tuple[float, float]:
    """(makespan, bubble fraction) of one rollout on ``engines`` engines. Speculation with
    ``accept`` tokens per verification forward turns a response of L tokens into ceil(L/accept)
    forwards, each scoring ``1 + draft_tokens`` tokens per row (and preceded by the
    ``drafter``'s forwards, if a model drafts)."""
    L = scale.lengths
    mean_len = float(np.mean([x for g in true for x in g]))
    avg_context = L.prompt_len + mean_len / 2
    spec = accept > 1.0
    cost = engine_cost(scale, scale.engine_gpus, scored=1.0 + (scale.draft_tokens if spec else 0.0),
                       avg_context=avg_context, drafter=drafter if spec else None)
    steps = [[int(np.ceil(x / accept)) for x in g] for g in true]
    if histopipe:
        guess = predicted_samples(prev, [len(g) for g in prev])
        # the prediction error a coordinator measures on its previous step: another epoch pair
        p2, t2 = L.draw(len(prev), len(prev[0]), np.random.default_rng(step + 1_000))
        err = log_error_sigma([np.mean(g) for g in p2], [np.mean(g) for g in t2])
        plan = make_plan("histopipe", [[x / accept for x in g] for g in guess], engines, cost=cost,
                         max_num_seqs=scale.max_num_seqs, step=step, prompt_len=float(L.prompt_len),
                         error_sigma=err, max_tokens=float(np.ceil(L.max_len / accept)))
    else:
        plan = make_plan("even", steps, engines, cost=cost, max_num_seqs=scale.max_num_seqs)
    r = simulate(plan, steps, L.prompt_len, cost, max_num_seqs=scale.max_num_seqs)
    return r.makespan_s, r.bubble_fraction


def train_time(scale: Scale, tokens: float, gpus: int) -> float:
    """Old log-probs (a forward) and the update (forward and backward): 8 x active params FLOPs per token."""
    g = scale.gpu
    return 8.0 * scale.model.active_params * tokens / (gpus * g.peak_flops * g.train_mfu)


def streamable_share(mini_batches: int) -> float:
    """The update's share that can start before a step's last group is in: the old log-probs
    (a forward: 2 of the 8 x active-params FLOPs per token) and the first mini-batch's forward
    and backward (6 of 8, over ``mini_batches``)."""
    return (2.0 + 6.0 / mini_batches) / 8.0


def step_time(scale: Scale, *, spec: str = "none", histopipe: bool = False, async_rl: bool = False,
              stream: bool = False, accept: float | None = None, seed: int = 0) -> StepTime:
    """One step of ``scale`` with the given techniques on: ``spec`` one of :data:`SPEC_METHODS`
    (``accept`` overrides its tokens per verification forward).

    ``stream`` (synchronous only): the finished groups' old log-probs and the first mini-batch's
    gradient run on the GPU-time the drained tail leaves idle (assumed usable at the update's
    own MFU: a model, see docs/projection.md), up to what can stream."""
    rng = np.random.default_rng(seed)
    prev, true = scale.lengths.draw(scale.prompts, scale.n, rng)
    a, drafter = speculation(scale, spec)
    if accept is not None and spec != "none":
        a = accept
    tokens = float(sum(sum(g) for g in true) + scale.prompts * scale.n * scale.lengths.prompt_len)
    sync = 2.0 * scale.model.total_params / scale.sync_bytes_s
    engines_all = scale.gpus // scale.engine_gpus
    if not async_rl:  # colocated: all GPUs generate, then all train
        r_s, r_bubble = rollout_time(scale, true, prev, engines_all, histopipe=histopipe, accept=a,
                                     drafter=drafter)
        t_s = train_time(scale, tokens, scale.gpus)
        hidden = min(streamable_share(scale.ppo_mini_batches) * t_s, r_bubble * r_s) if stream else 0.0
        step = r_s + t_s - hidden + sync
        return StepTime(step, r_s, t_s - hidden, sync, (r_bubble * r_s - hidden + sync) / step)
    cache: dict[int, StepTime] = {}

    def split(engines: int) -> StepTime:
        """Rollout on ``engines`` engines' GPUs, the update on the rest, overlapped."""
        if engines not in cache:
            g_r = engines * scale.engine_gpus
            g_t = scale.gpus - g_r
            r_s, r_bubble = rollout_time(scale, true, prev, engines, histopipe=histopipe, accept=a, drafter=drafter)
            t_s = train_time(scale, tokens, g_t)
            step = max(r_s, t_s) + sync
            idle = g_r * (step - r_s * (1 - r_bubble)) + g_t * (step - t_s)
            cache[engines] = StepTime(step, r_s, t_s, sync, idle / (scale.gpus * step))
        return cache[engines]

    # More rollout engines: a shorter rollout and a longer update; the best split is where they
    # cross (bisection on the sign of their difference), or next to it.
    lo, hi = 1, engines_all - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        t = split(mid)
        if t.rollout_s > t.train_s:
            lo = mid
        else:
            hi = mid
    return min((split(e) for e in {lo, hi}), key=lambda t: t.step_s)


VARIANTS = {
    "baseline": {},
    "+histospec": {"spec": "histospec"},
    "+histopipe": {"histopipe": True},
    "+async": {"async_rl": True},
    "+stream": {"stream": True},
    "all": {"spec": "histospec", "histopipe": True, "async_rl": True},
    "all_sync+stream": {"spec": "histospec", "histopipe": True, "stream": True},
    "+draft_model": {"spec": "draft_model"},
    "+draft_head": {"spec": "draft_head"},
    "+hybrid": {"spec": "hybrid"},
    "all_hybrid": {"spec": "hybrid", "histopipe": True, "async_rl": True},
}


def project(scale: Scale, seed: int = 0) -> list[dict]:
    """Rows of the projection for one scale: every variant's step, against the baseline's."""
    times = {name: step_time(scale, seed=seed, **kw) for name, kw in VARIANTS.items()}
    base = times["baseline"].step_s
    return [{"scale": scale.name, "variant": name, "step_s": t.step_s, "speedup": base / t.step_s,
             "rollout_s": t.rollout_s, "train_s": t.train_s, "sync_s": t.sync_s,
             "rollout_share": t.rollout_share, "bubble_fraction": t.bubble_fraction}
            for name, t in times.items()]


def sensitivity(scale: Scale, accepts: tuple[float, ...], sigmas: tuple[float, ...],
                seed: int = 0) -> list[dict]:
    """The speed-up of everything combined over the baseline as the acceptance length and the
    length distribution's tail (sigma across prompts) move."""
    rows = []
    for sigma in sigmas:
        s = replace(scale, lengths=replace(scale.lengths, sigma=sigma))
        base = step_time(s, seed=seed).step_s
        for a in accepts:
            t = step_time(s, spec="histospec", histopipe=True, async_rl=True, accept=a, seed=seed)
            spec_only = step_time(s, spec="histospec", accept=a, seed=seed)
            rows.append({"scale": scale.name, "sigma": sigma, "accept": a, "speedup_all": base / t.step_s,
                         "speedup_histospec": base / spec_only.step_s})
    return rows


# --- this machine: the model checked against measured steps (``rhymerl bench e2e``) ----------------
@dataclass(frozen=True)
class LocalCosts:
    """This machine's costs, measured apart from the runs they predict (``bench e2e`` calibrates
    them before and after, :mod:`rhymerl.bench.calibrate`): the engine's step curve in this process (all
    cores) and in a one-thread worker process, the trainer's seconds per token (old log-probs
    and update, ``train_threads``), the history drafter's seconds per decode row, and what
    processes running at once cost each other (measured side by side)."""

    engine: StepCost
    engine_1t: StepCost
    train_s_per_token: float
    cores: int
    train_threads: int = 1
    logp_share: float = 0.0  # of the trainer's time, the old log-probs' (the rest is the update)
    engine_pair_slowdown: float = 1.0  # a one-thread engine beside another
    history_draft_s_per_row: float = 0.0
    # (engine, trainer) slow-downs while a lone worker generates beside the trainer on the
    # cores the worker leaves (a streamed update's helper, async RL's update), the trainer's
    # relative to its time alone on every core; (0, 0): not measured, derived from the threads
    beside_rest: tuple[float, float] = (0.0, 0.0)
    rest_alone: float = 0.0  # the trainer alone on those cores, over alone on every core (0: derived)

    def rest_slowdowns(self, worker_threads: int) -> tuple[float, float, float]:
        """(rollout, trainer, trainer after the rollout) slow-downs when the trainer runs on the
        cores a lone worker of ``worker_threads`` threads leaves (a streamed update's helper,
        async RL's update), the trainer's relative to its time alone on every core."""
        helper = max(1, self.cores - worker_threads)
        after = self.rest_alone if self.rest_alone > 0 else max(1.0, self.train_threads / helper)
        if self.beside_rest[0] > 0:
            return self.beside_rest[0], self.beside_rest[1], after
        slow_r, slow_t = shared_slowdowns(self.cores, worker_threads, helper)
        return slow_r, slow_t * after, after


def scored_cost(cost: StepCost, scored_per_row: float, draft_s_per_row: float = 0.0) -> StepCost:
    """A verification step's curve: on a CPU a forward's time follows the tokens it scores, so
    a batch of B rows scoring ``s`` tokens each costs what B x s rows of one token cost; plus the
    drafter's own seconds for each row it drafts for."""
    return StepCost(cost.batch, tuple(cost.step_s(max(1, int(round(b * scored_per_row)))) + b * draft_s_per_row
                                      for b in cost.batch),
                    cost.prefill_per_token_s, f"{cost.name}, {scored_per_row:.2f} scored per row")


def shared_slowdowns(cores: int, rollout_threads: int, train_threads: int) -> tuple[float, float]:
    """How much slower each side runs while both do, on ``cores`` shared cores.

    The trainer's matmuls are fork-join over its threads: a region ends with its slowest
    thread, so once threads outnumber cores the trainer runs at the pace of a thread that shares
    its core with as many others as the busiest core holds. The rollout worker's threads each get
    an equal share of the cores."""
    total = rollout_threads + train_threads
    if total <= cores:
        return 1.0, 1.0
    busiest = -(-total // cores)  # threads on the most crowded core
    return total / cores, float(busiest)


def local_rollout_s(costs: LocalCosts, forwards: list[list[int]], prompt_lens: list[int], **kw: Any) -> float:
    """One rollout's seconds: each sample takes as many engine steps as it took forwards (its
    recorded trace), each step costing what its batch scores (:func:`local_rollout`)."""
    return local_rollout(costs, forwards, prompt_lens, **kw).makespan_s


def streamed_s(rollout_s: float, done_s: list[float], logp_s: list[float], grad_s: list[float], rest_s: float,
               slow_rollout: float, slow_train: float) -> float:
    """A step whose update streams into its rollout (``trainer.stream_update``), groups in
    processing order: a group's log-probs (``logp_s``) can run once it is done (``done_s``, on the
    rollout's own clock), its share of the first mini-batch's gradient (``grad_s``) only after
    every group before it (:class:`rhymerl.training.update.stream.StreamedUpdate`: the next group in
    order if it is done, else the log-probs of any later one that is). While both run, the
    rollout goes ``slow_rollout`` and the work ``slow_train`` times slower (shared cores); once
    the rollout ends the work left runs at about its speed alone (a second thread joins the
    helper), then the rest of the update (``rest_s``)."""
    n = len(done_s)
    t = tau = 0.0  # wall clock; the rollout's own progress
    prepared = [False] * n
    nxt = 0

    def run(w: float) -> None:
        nonlocal t, tau
        if tau < rollout_s:  # both run until one of them is done
            dt = min(w * slow_train, (rollout_s - tau) * slow_rollout)
            t += dt
            tau += dt / slow_rollout
            w -= dt / slow_train
        t += max(0.0, w)

    while nxt < n:
        if done_s[nxt] <= tau or tau >= rollout_s:
            run((0.0 if prepared[nxt] else logp_s[nxt]) + grad_s[nxt])
            prepared[nxt] = True
            nxt += 1
            continue
        later = next((i for i in range(nxt + 1, n) if not prepared[i] and done_s[i] <= tau), None)
        if later is not None:
            run(logp_s[later])
            prepared[later] = True
            continue
        land = min(rollout_s, min(done_s[i] for i in range(nxt, n) if not prepared[i]))
        t += land - tau  # nothing has landed: the rollout runs alone until a group does
        tau = land
    t += max(0.0, rollout_s - tau)
    return t + rest_s


def local_rollout(costs: LocalCosts, forwards: list[list[int]], prompt_lens: list[int], *, workers: int,
                  policy: str, predicted: list[float | None], scored_per_row: float, max_num_seqs: int,
                  in_process: bool, threads: int = 1, drafts: bool = False):
    """The whole simulation of one rollout (when each prompt's group was done, too): in this
    process on all cores, or on ``workers`` worker processes of ``threads`` threads each that
    share the cores; ``drafts``: the history drafter's time per row counts in each step."""
    draft = costs.history_draft_s_per_row if drafts else 0.0
    if in_process:
        cost, cores, contention = scored_cost(costs.engine, scored_per_row, draft), None, 1.0
    else:
        curve = costs.engine_1t if threads == 1 else costs.engine
        cost, cores = scored_cost(curve, scored_per_row, draft), float(costs.cores)
        contention = costs.engine_pair_slowdown if workers > 1 else 1.0
    known = [p for p in predicted if p is not None]
    fill = float(np.median(known)) if known else 1.0
    guess = [[(p if p is not None else fill)] * len(f) for p, f in zip(predicted, forwards)]
    plan = make_plan(policy if workers > 1 else "even", guess, workers,
                     cost=cost, max_num_seqs=max_num_seqs, prompt_len=float(np.mean(prompt_lens)))
    return simulate(plan, forwards, prompt_lens, cost, max_num_seqs=max_num_seqs, cores=cores, threads=threads,
                    contention=contention)


def overlapped_s(rollout_alone: float, train_alone: float, slow_rollout: float, slow_train: float,
                 slow_train_after: float = 1.0) -> float:
    """Two jobs side by side, each ``slow_*`` times slower while both run, then the one left at
    its own speed (the trainer ``slow_train_after`` times slower: it keeps its thread count):
    the time until both are done. On shared cores the slow-downs follow from the threads
    (:func:`shared_slowdowns`)."""
    r_rate, t_rate = 1.0 / slow_rollout, 1.0 / slow_train
    first = min(rollout_alone / r_rate, train_alone / t_rate)  # both running until one ends
    left_r = max(0.0, rollout_alone - first * r_rate)
    left_t = max(0.0, train_alone - first * t_rate)
    return first + left_r + left_t * slow_train_after
