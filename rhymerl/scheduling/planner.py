"""Plans for one rollout step: which worker runs which samples, in what order.

Policies (all keep the step's barrier: nothing here is off-policy):

- ``even``: the batch cut into equal contiguous parts, one per worker (verl's default split).
- ``least_loaded``: each sample sent to the worker with the fewest outstanding requests at
  dispatch time (verl / OpenRLHF routing). A step dispatches its whole batch at once, so
  this balances counts, not work.
- ``histopipe``: placement from the lengths predicted from history and the cost curve:
  contiguous groups of the length ranking with a budget found by binary search (the
  paper's; allocation: a worker gets few long samples or many short ones), the same cut
  over prompts' length *distributions* (``spread``: each sample priced with its prompt's
  whole spread and the measured prediction error, see :mod:`rhymerl.scheduling.length_risk`;
  siblings split wherever the cut falls), LPT over prompts (long and short work mixed), or the
  samples ranked by risk and dealt across the workers in turn (``stripe``: every worker an equal
  share of each risk band), whichever the simulator finishes first on lengths drawn with the
  prediction's error; groups
  placed on workers in complementary order across steps (odd steps group 0 on worker 0,
  even steps reversed), each worker's queue longest first; at run time, tail migration.
- ``prompt_oracle``: HistoPipe's plan from each prompt's true lengths with the siblings'
  identities dropped (a prompt's samples are exchangeable): the best any prediction per prompt
  can do, a bound for placements that know prompts but not which sibling runs long.
- ``oracle``: the same plan from the true lengths (a bound no real run can have).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from rhymerl.scheduling.cost import StepCost
from rhymerl.scheduling.length_risk import (
    GroupTime,
    LengthDists,
    cut_at_budget,
    cut_contiguous,
    smallest_budget,
)
from rhymerl.scheduling.plan import Plan, WorkUnit
from rhymerl.scheduling.simulator import simulate

POLICIES = ("even", "least_loaded", "histopipe", "prompt_oracle", "oracle")
ORACLES = ("prompt_oracle", "oracle")  # planned from the true lengths: bounds for the bench
SCHEDULES = tuple(p for p in POLICIES if p not in ORACLES)  # what a run's rollout.schedule can be


def _merge(units: list[tuple[int, int]]) -> list[WorkUnit]:
    """Consecutive samples of one prompt become one unit (they share a prefill and siblings)."""
    out: list[WorkUnit] = []
    for p, s in units:
        if out and out[-1].prompt == p:
            out[-1] = WorkUnit(p, out[-1].samples + (s,))
        else:
            out.append(WorkUnit(p, (s,)))
    return out


def estimate_s(lengths_sum: float, longest: float, count: int, cost: StepCost, max_num_seqs: int,
               prefill_tokens: float = 0.0) -> float:
    """Time for one worker to decode ``count`` samples of total ``lengths_sum`` tokens.

    With a cost line ``base + per_seq * B``: every token costs ``per_seq`` once, and the step
    overhead is paid once per step, i.e. for the longest sample, or for the total divided by
    the slots when the samples outnumber them. Plus ``prefill_tokens`` of prefill.
    """
    if count == 0:
        return 0.0
    steps = longest if count <= max_num_seqs else max(longest, lengths_sum / max_num_seqs)
    return cost.base_s * steps + cost.per_seq_s * lengths_sum + cost.prefill_per_token_s * prefill_tokens


def _prefill_tokens(prompt_len: float, count: int, n_prompts: int, max_num_seqs: int) -> float:
    """Prompt tokens a worker prefills for ``count`` samples of ``n_prompts`` prompts: samples of
    a prompt admitted together share a prefill; once slots run out they are admitted one by
    one, each with its own."""
    return prompt_len * (n_prompts if count <= max_num_seqs else count)


class _RunTime:
    """``estimate_s`` of any contiguous run ``[a, b)`` of ranked samples in O(1): prefix sums of
    lengths and of prompt starts, and a sparse table of range maxima (the run's longest)."""

    def __init__(self, lengths: np.ndarray, prompts: np.ndarray, cost: StepCost, max_num_seqs: int,
                 prompt_len: float) -> None:
        self.cost, self.slots, self.prompt_len = cost, max_num_seqs, prompt_len
        x = np.asarray(lengths, dtype=np.float64)
        new_p = np.ones(len(x), dtype=np.int64)
        new_p[1:] = prompts[1:] != prompts[:-1]
        self.csum = np.concatenate([[0.0], np.cumsum(x)]).tolist()
        self.cnp = np.concatenate([[0], np.cumsum(new_p)]).tolist()
        levels, k = [x], 1
        while 2 * k <= len(x):
            levels.append(np.maximum(levels[-1][:-k], levels[-1][k:]))
            k *= 2
        self.levels = [lv.tolist() for lv in levels]

    def __call__(self, a: int, b: int) -> float:
        count = b - a
        if count <= 0:
            return 0.0
        j = count.bit_length() - 1
        level = self.levels[j]
        longest = max(level[a], level[b - (1 << j)])
        n_p = self.cnp[b] - self.cnp[a + 1] + 1  # the run's first sample starts a prompt for it
        return estimate_s(self.csum[b] - self.csum[a], longest, count, self.cost, self.slots,
                          _prefill_tokens(self.prompt_len, count, n_p, self.slots))


def _partition(est: _RunTime, n: int, R: int) -> list[int]:
    """Cut ``n`` ranked samples (siblings adjacent) into at most R contiguous groups minimising
    the largest estimated group time; returns the boundaries (first 0, last ``n``). Each group's
    end is a binary search (:func:`cut_at_budget`), O(R log n) per budget tried."""
    lo = max(est(i, i + 1) for i in range(n))
    return smallest_budget(lambda budget: cut_at_budget(est, n, R, budget), lo, est(0, n), [0, n])


def _use_all_workers(bounds: list[int], est: _RunTime, R: int) -> list[int]:
    """While fewer groups than workers: split the group estimated slowest where its two halves
    balance best (allocation: the longest work gets the spare workers)."""
    bounds = list(bounds)
    while len(bounds) - 1 < R:
        ests = [est(bounds[g], bounds[g + 1]) for g in range(len(bounds) - 1)]
        g = int(np.argmax(ests))
        a, b = bounds[g], bounds[g + 1]
        if b - a < 2:
            break
        best = min(range(a + 1, b), key=lambda i: max(est(a, i), est(i, b)))  # the first of equals
        bounds.insert(g + 1, best)
    return bounds


PLACEMENTS = ("auto", "even", "least_loaded", "lpt_samples", "lpt", "contiguous", "spread", "stripe")


def make_plan(policy: str, lengths: list[list[float]] | np.ndarray, num_workers: int, *,
              cost: StepCost, max_num_seqs: int, step: int = 1, complementary: bool = True,
              migrate: bool = True, prompt_len: float = 0.0, placement: str = "auto",
              error_sigma: float = 0.0, max_tokens: float | None = None) -> Plan:
    """Plan one step.

    Args:
        policy: one of :data:`POLICIES`.
        lengths: per prompt, per sample: the lengths the policy may use. ``histopipe`` gets
            predictions (the prompt's previous lengths, as a distribution of n values),
            ``oracle`` and ``prompt_oracle`` the true lengths; ``even`` and ``least_loaded``
            only use the shape.
        num_workers: R.
        cost: the workers' step-time curve (allocation uses it).
        max_num_seqs: slots per worker.
        step: the RL step (complementary order alternates on it).
        complementary: odd steps place the longest group on worker 0, even steps on worker R-1.
        migrate: tail migration at run time (histopipe and prompt_oracle).
        prompt_len: mean prompt tokens (prefill cost in the estimates).
        placement: ``lpt`` (prompts, longest predicted work first, each to the worker whose
            estimate is lowest: long and short work mix), ``contiguous`` (the paper's
            groups: the ranking cut into contiguous groups by a binary-searched budget),
            ``spread`` (the same cut, each group priced under the prompts' length
            distributions), ``stripe`` (samples ranked by risk, dealt to the workers in snake
            order), or ``auto`` (whichever the simulator finishes first on average over two
            draws of lengths from those distributions, seeded by the step).
        error_sigma: how far (log) a prompt's mean length moved from its prediction on the
            last step (the coordinator measures it); ``spread`` and ``auto`` price it in.
        max_tokens: the requests' length limit (lengths are clipped there).
    """
    if policy not in POLICIES:
        raise ValueError(f"scheduling policy {policy!r} is not one of {POLICIES}")
    R = num_workers
    lens = [list(map(float, x)) for x in lengths]
    if policy == "prompt_oracle":  # which sibling is which is what no prediction per prompt can know
        lens = [sorted(x, reverse=True) for x in lens]
    if policy in ("even", "least_loaded"):  # the shape alone
        return Plan(policy, [_merge(w) for w in (_even if policy == "even" else _least_loaded)(lens, R)])
    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r} is not one of {PLACEMENTS}")
    # What "past its prediction" means at run time (tail migration): the prompt's typical
    # length. Its largest previous length started moves later than the drained tail pays for.
    predicted = np.array([float(np.mean(x)) if x else 0.0 for x in lens])
    tail_moves = migrate and policy in ("histopipe", "prompt_oracle")
    dists = LengthDists.from_samples(lens, error_sigma if policy == "histopipe" else 0.0, max_tokens)
    candidates = _placements(lens, dists, R, cost, max_num_seqs, prompt_len)
    if placement == "auto" and R == 1:
        placement = "contiguous"  # one worker: every placement is the same, no need to simulate them
    if placement != "auto":
        groups = candidates[placement]()
    else:
        def simulated_s(gs: list[list[tuple[int, int]]], judged: list) -> float:
            plan = Plan(policy, [_merge(g) for g in gs], migrate=tail_moves, predicted=predicted)
            return float(np.mean([simulate(plan, j, int(round(prompt_len)), cost, max_num_seqs=max_num_seqs).makespan_s
                                  for j in judged]))
        placement, groups = _auto_choice(policy, lens, dists, candidates, step, simulated_s)
    if complementary and step % 2 == 0:
        groups = groups[::-1]
    return Plan(policy, [_merge(g) for g in groups], migrate=tail_moves, predicted=predicted, placement=placement)


def placement_groups(lengths: list[list[float]], num_workers: int, names: tuple[str, ...], *, cost: StepCost,
                     max_num_seqs: int, prompt_len: float = 0.0, error_sigma: float = 0.0,
                     max_tokens: float | None = None) -> dict[str, list[list[WorkUnit]]]:
    """Each named placement's groups (HistoPipe's, worker 0 first) from one set of predicted
    lengths, the length distributions built once: what the coordinator scores after a step."""
    lens = [list(map(float, x)) for x in lengths]
    dists = LengthDists.from_samples(lens, error_sigma, max_tokens)
    candidates = _placements(lens, dists, num_workers, cost, max_num_seqs, prompt_len)
    return {name: [_merge(g) for g in candidates[name]()] for name in names}


def _even(lens: list[list[float]], R: int) -> list[list[tuple[int, int]]]:
    """Prompts cut into R contiguous runs of equal count, whatever their lengths."""
    P = len(lens)
    work: list[list[tuple[int, int]]] = [[] for _ in range(R)]
    for p in range(P):
        work[p * R // max(1, P)].extend((p, s) for s in range(len(lens[p])))
    return work


def _placements(lens: list[list[float]], dists: LengthDists, R: int, cost: StepCost, max_num_seqs: int,
                prompt_len: float) -> dict[str, Callable[[], list[list[tuple[int, int]]]]]:
    """Every placement by name, each built on demand."""
    return {
        # Placements that know nothing of lengths, or little: named, and among what a coordinator
        # scores on real outcomes (placement_scores.py); judged on draws from the predictions
        # (auto here) they would always look worst, so they are not auto's candidates.
        "even": lambda: _even(lens, R),
        "least_loaded": lambda: _least_loaded(lens, R),
        "lpt_samples": lambda: _lpt_samples(lens, R, cost, max_num_seqs, prompt_len),
        "lpt": lambda: _lpt(lens, R, cost, max_num_seqs, prompt_len),
        "contiguous": lambda: _contiguous(lens, R, cost, max_num_seqs, prompt_len),
        "spread": lambda: _spread(dists, [len(x) for x in lens], R, cost, max_num_seqs, prompt_len),
        "stripe": lambda: _stripe(dists, [len(x) for x in lens], R),
    }


def _auto_choice(policy: str, lens: list[list[float]], dists: LengthDists, candidates: dict, step: int,
                 simulated_s: Callable[[list, list], float]) -> tuple[str, list[list[tuple[int, int]]]]:
    """``auto``: the candidate the simulator finishes first. Candidates are compared by
    simulating them (the closed-form estimate reads the cost curve as a line), on lengths drawn
    with the prediction's measured error rather than on the point predictions (judged on those,
    the placement that trusts them most always looks best). The oracle knows the lengths and is
    judged on them. ``simulated_s``: a plan's mean makespan over the draws, the expected one
    (the worse of two draws ranks plans by how much they vary instead); still optimistic for
    `spread`, which is built on the distribution it is judged on (docs/design.md, HistoPipe)."""
    rng = np.random.default_rng(step)
    if policy == "oracle":
        judged = [lens]
    elif policy == "prompt_oracle":  # the true lengths, dealt to the siblings at random
        judged = [[rng.permutation(x).tolist() for x in lens] for _ in range(2)]
    else:
        judged = [dists.draw([len(x) for x in lens], rng) for _ in range(2)]
    names = ("lpt", "contiguous") if policy == "oracle" else ("lpt", "contiguous", "spread", "stripe")
    return min(((name, candidates[name]()) for name in names), key=lambda c: simulated_s(c[1], judged))


def _least_loaded(lens: list[list[float]], R: int) -> list[list[tuple[int, int]]]:
    """Each sample, in arrival order, to the worker with the fewest so far (verl's routing of a
    batch dispatched at once: it balances counts)."""
    work: list[list[tuple[int, int]]] = [[] for _ in range(R)]
    i = 0
    for p in range(len(lens)):
        for s in range(len(lens[p])):
            work[i % R].append((p, s))
            i += 1
    return work


def _lpt_samples(lens: list[list[float]], R: int, cost: StepCost, max_num_seqs: int,
                 prompt_len: float) -> list[list[tuple[int, int]]]:
    """Samples longest predicted first, each to the worker whose estimated time is lowest: what
    dispatching a ranked queue to whichever worker frees first does (siblings scatter)."""
    import heapq

    order = sorted(((p, s) for p in range(len(lens)) for s in range(len(lens[p]))), key=lambda u: -lens[u[0]][u[1]])
    state = [(0.0, w) for w in range(R)]
    acc = [[0.0, 0.0, 0, set()] for _ in range(R)]  # sum, longest, count, prompts
    groups: list[list[tuple[int, int]]] = [[] for _ in range(R)]
    for p, s in order:
        _, w = heapq.heappop(state)
        a = acc[w]
        x = lens[p][s]
        a[0] += x
        a[1] = max(a[1], x)
        a[2] += 1
        a[3].add(p)
        groups[w].append((p, s))
        prefill = _prefill_tokens(prompt_len, a[2], len(a[3]), max_num_seqs)
        heapq.heappush(state, (estimate_s(a[0], a[1], a[2], cost, max_num_seqs, prefill), w))
    return groups


def _lpt(lens: list[list[float]], R: int, cost: StepCost, max_num_seqs: int,
         prompt_len: float) -> list[list[tuple[int, int]]]:
    """Longest-processing-time-first over prompts: a prompt's samples go together to the
    worker with the lowest estimated time so far (split in chunks only when there are
    fewer prompts than workers); each worker then runs its longest samples first."""
    import heapq

    P = len(lens)
    chunks = max(1, -(-R // max(1, P)))  # ceil(R / P): pieces per prompt
    units = []
    for p in range(P):
        order = sorted(range(len(lens[p])), key=lambda s: -lens[p][s])
        k = max(1, min(chunks, len(order)))
        for c in range(k):
            part = order[c::k]
            if part:
                units.append((p, part))

    def work(p: int, part: list[int]) -> float:
        return estimate_s(sum(lens[p][s] for s in part), max(lens[p][s] for s in part), len(part), cost,
                          max_num_seqs, prompt_len)

    units.sort(key=lambda u: -work(*u))
    state = [(0.0, w) for w in range(R)]  # (estimate, worker)
    heapq.heapify(state)
    acc = [[0.0, 0.0, 0, 0] for _ in range(R)]  # sum, longest, count, prompts
    groups: list[list[tuple[int, int]]] = [[] for _ in range(R)]
    for p, part in units:
        _, w = heapq.heappop(state)
        a = acc[w]
        a[0] += sum(lens[p][s] for s in part)
        a[1] = max(a[1], max(lens[p][s] for s in part))
        a[2] += len(part)
        a[3] += 1
        groups[w].extend((p, s) for s in part)
        prefill = _prefill_tokens(prompt_len, a[2], a[3], max_num_seqs)
        heapq.heappush(state, (estimate_s(a[0], a[1], a[2], cost, max_num_seqs, prefill), w))
    mean = [np.mean(x) if len(x) else 0.0 for x in lens]  # per prompt, once
    for g in groups:  # longest first; siblings stay adjacent
        g.sort(key=lambda u: (-mean[u[0]], u[0], -lens[u[0]][u[1]]))
    return groups


def _spread(dists: LengthDists, n: list[int], R: int, cost: StepCost, max_num_seqs: int,
            prompt_len: float) -> list[list[tuple[int, int]]]:
    """The ranking of prompts by risk (log length one spread above the centre), siblings
    adjacent, cut into contiguous groups priced by :class:`GroupTime`: the riskiest samples
    share lightly loaded workers, the safe ones fill the rest (and may queue)."""
    order = np.argsort(-dists.risk(), kind="stable")
    units = [(int(p), s) for p in order for s in range(n[p])]
    if not units:
        return [[] for _ in range(R)]
    unit_prompt = np.array([p for p, _ in units])
    est = GroupTime(dists, unit_prompt, np.asarray(n), cost, max_num_seqs, prompt_len)
    bounds = cut_contiguous(est, len(units), R)
    groups = [units[bounds[g]:bounds[g + 1]] for g in range(len(bounds) - 1)]
    return groups + [[] for _ in range(R - len(groups))]


def _stripe(dists: LengthDists, n: list[int], R: int) -> list[list[tuple[int, int]]]:
    """Samples ranked by their prompt's risk and dealt across the workers in snake order (0 to
    R-1, then back): each worker gets an equal share of every risk band, longest first. Where a
    prompt's samples scatter widely, no plan knows which sibling runs long; least-loaded routing
    deals in arrival order and balances the bands by chance, this deals them by design."""
    order = np.argsort(-dists.risk(), kind="stable")
    groups: list[list[tuple[int, int]]] = [[] for _ in range(R)]
    i = 0
    for p in order:
        for s in range(n[p]):
            lap, j = divmod(i, R)
            groups[j if lap % 2 == 0 else R - 1 - j].append((int(p), s))
            i += 1
    return groups


def _contiguous(lens: list[list[float]], R: int, cost: StepCost, max_num_seqs: int,
                prompt_len: float) -> list[list[tuple[int, int]]]:
    P = len(lens)
    units = [(p, s) for p in range(P) for s in range(len(lens[p]))]
    flat = np.array([lens[p][s] for p, s in units], dtype=np.float64)
    # Rank prompts by their mean (predicted or true) length, samples longest first within a
    # prompt: siblings stay adjacent, so a cut rarely splits a prompt (they share a prefill).
    prompt_mean = [np.mean(x) if len(x) else 0.0 for x in lens]  # once per prompt, not per sample
    mean = np.array([prompt_mean[p] for p, _ in units])
    order = np.lexsort((-flat, np.array([p for p, _ in units]), -mean))
    ranked = flat[order]
    prompt_of = np.array([units[i][0] for i in order])
    if len(ranked):
        est = _RunTime(ranked, prompt_of, cost, max_num_seqs, prompt_len)
        bounds = _use_all_workers(_partition(est, len(ranked), R), est, R)
    else:
        bounds = [0, 0]
    groups = [[units[i] for i in order[bounds[g]:bounds[g + 1]]] for g in range(len(bounds) - 1)]
    return groups + [[] for _ in range(R - len(groups))]
