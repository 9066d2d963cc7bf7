"""The speculation controller: the engine's proposer over a set of draft sources.

It owns what is common to every source: each request's adaptive draft length and the choice
of source per request (the batch gate, which decides whether drafting pays on this machine at
all, is :class:`rhymerl.drafting.gate.Gate`):

- ``longest_match`` (HistoSpec): the index sources' longest matching context wins; equal
  matches of merging sources pool their occurrences; fallback sources are asked only where
  nothing matched as long as the pattern allows. From the winner's occurrences it follows
  the heaviest branch (a path) or grows a best-first tree.
- ``best_expected`` (hybrid): every source answers, and a request drafts from the one with
  the highest expected accepted length: the candidate's own probabilities (occurrence
  counts, or the model's) times that source's measured calibration (accepted over
  expected, from what verification accepted).

A method is a list of sources plus a rule, one line in :data:`METHODS`.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from rhymerl.drafting.config import SpecConfig
from rhymerl.drafting.gate import Gate
from rhymerl.drafting.length_policy import POLICIES, resolve
from rhymerl.drafting.source import Candidate, DraftSource, IndexSource, SourceContext, get_source
from rhymerl.drafting.suffix_index import longest_match_drafts
from rhymerl.engine.cost_model import CostModel
from rhymerl.engine.draft import DraftBatch, DraftTree, Proposer
from rhymerl.engine.sequence import Sequence

log = logging.getLogger(__name__)


class _Pending(NamedTuple):
    """A drafting step's batch and, per row, its draft's source (None: no draft), node
    probabilities and supports (as :meth:`SpecController._draft` returns them)."""

    seqs: list[Sequence]
    batch: DraftBatch
    names: list[str | None]
    probs: Any
    support: Any
INDEX = "index"  # the gate's name for the index sources' drafting, measured as one (one compiled call)


@dataclass(frozen=True)
class Method:
    sources: tuple[str, ...]
    rule: str  # longest_match | best_expected


def _model_source(cfg: SpecConfig) -> tuple[str, ...]:
    if cfg.draft_model:
        return ("draft_model",)
    if cfg.draft_head is not None or cfg.method in ("draft_head", "hybrid"):
        return ("draft_head",)
    return ()


HISTORY = ("prompt_history", "siblings", "global_history")
METHODS: dict[str, Any] = {
    "history": lambda cfg: Method(HISTORY, "longest_match"),
    "ngram": lambda cfg: Method(("ngram",), "longest_match"),
    "draft_model": lambda cfg: Method(("draft_model",), "longest_match"),
    "draft_head": lambda cfg: Method(("draft_head",), "longest_match"),
    "hybrid": lambda cfg: Method(HISTORY + _model_source(cfg), "best_expected"),
}


def get_method(name: str):
    if name not in METHODS:
        raise ValueError(f"speculative.method {name!r} is not one of {sorted(METHODS) + ['none']}")
    return METHODS[name]


class Calibration:
    """Per source: how many tokens verification accepted per token its probabilities expected
    (EMA), so counts from a handful of occurrences and a model's confidence compare fairly."""

    def __init__(self, prior: float = 0.7, decay: float = 0.95) -> None:
        self.prior, self.decay = prior, decay
        self.ratio: dict[str, float] = {}

    def __call__(self, source: str) -> float:
        return self.ratio.get(source, self.prior)

    def update(self, source: str, expected: float, accepted: int) -> None:
        if expected <= 0:
            return
        r = min(2.0, accepted / expected)
        self.ratio[source] = self.decay * self(source) + (1 - self.decay) * r


class SpecController(Proposer):
    """A :class:`rhymerl.engine.Proposer` drafting from ``sources`` (built from the config's
    method when not given), behind a :class:`Gate`."""

    def __init__(self, cfg: SpecConfig | None = None, store=None, *, target=None, target_path: str | None = None,
                 sources: list[DraftSource] | None = None, rule: str | None = None,
                 with_probs: bool = False) -> None:
        """``with_probs``: keep each draft's node probabilities for :meth:`row_probs` under any rule."""
        self.cfg = cfg = cfg or SpecConfig()
        self.store = store
        if sources is None:
            method = get_method(cfg.method)(cfg)
            names = tuple(cfg.sources) if cfg.sources is not None else method.sources
            if not names:
                raise ValueError(f"speculative.method {cfg.method!r}: no draft source (set draft_model or draft_head)")
            ctx = SourceContext(cfg, store, target, target_path)
            sources = [get_source(n)(ctx) for n in names]
            rule = rule or method.rule
        self.sources = sources
        self._names = tuple(src.name for src in sources)
        self.rule = rule or "longest_match"
        self._wants_probs = self.rule == "best_expected"  # the only rule that reads drafts' probabilities
        self._with_probs = with_probs or self._wants_probs
        policy = resolve(cfg.length_policy)
        if policy not in POLICIES:
            raise ValueError(f"speculative.length_policy {cfg.length_policy!r} is not one of {['auto'] + sorted(POLICIES)}")
        self.policy, cap = POLICIES[policy]
        self.cap = min(cap, cfg.index_draft_tokens)
        self.first = self.policy(0, 0, 0, cap=self.cap)  # a new row's draft length: the policy's start
        self.max_nodes = max(cfg.tree_budget, self.cap)
        for s in sources:
            self.max_nodes = max(self.max_nodes, s.max_nodes)
        self.wants_hidden = any(s.wants_hidden for s in sources)
        # The source sets the gate chooses between: every source, then the cheap (index) ones
        # alone where some run a model (they may pay where a draft model's forwards do not).
        cheap = [s for s in sources if not s.runs_a_model]
        self._source_sets = [sources] + ([cheap] if cheap and len(cheap) < len(sources) else [])
        self.gate = Gate(enabled=cfg.gate, cap=self.cap, max_nodes=self.max_nodes,
                         set_names=[{INDEX if isinstance(src, IndexSource) else src.name for src in option}
                                    for option in self._source_sets],
                         runs_model=[any(src.runs_a_model for src in option) for option in self._source_sets],
                         reads_history=[any(src.store is not None for src in option)
                                        for option in self._source_sets])
        self._store_version = getattr(store, "version", None)
        self.calibration = Calibration()
        self.step = 0
        # This step's drafts: what observe() reads for the rows verification scored (the engine
        # passes the same list).
        self._pending: _Pending | None = None
        self.accepted_by_source: Counter[str] = Counter()
        self.drafted_by_source: Counter[str] = Counter()

    # --- engine hooks -----------------------------------------------------------------
    @property
    def wants_cost_model(self) -> bool:
        return self.cfg.gate

    def attach_cost_model(self, cost: CostModel) -> None:
        self.gate.cost_model = cost

    def begin(self, step: int) -> None:
        """A new rollout step: the gate judges the last one and relaxes; the sources see the step."""
        self.step = step
        version = getattr(self.store, "version", None)
        changed = version != self._store_version  # new history: sets that read it may pay now
        self._store_version = version
        self.gate.begin(changed)
        for s in self.sources:
            s.begin(step)

    def propose(self, seqs: list[Sequence]) -> DraftBatch | None:
        choice = self.gate.choose(len(seqs))
        if choice is None:
            return None
        B = len(seqs)
        t0 = time.perf_counter()
        cap, first = choice.cap, self.first
        # Each row's draft length within the cap and the room it has left (comparisons, not
        # min/max calls: this runs on every row of every drafting step).
        caps = [0 if room <= 0 else (d if d < room else room)
                for s in seqs
                for d, room in (((s.draft_len or first) if (s.draft_len or first) < cap else cap,
                                 s.limit - len(s.output_ids) - 1),)]
        batch, names, probs, support = self._draft(seqs, caps, self._source_sets[choice.option], B.bit_length())
        lengths = batch.lengths if batch is not None else [0] * B
        k = self.gate.judge(lengths, sum(caps), time.perf_counter() - t0, found=batch is not None)
        if k == 0:
            return None
        batch = batch.truncated(k)
        self._pending = _Pending(seqs, batch, names, probs, support)
        return batch

    def _draft(self, seqs: list[Sequence], caps: list[int], sources: list[DraftSource],
               bucket: int) -> tuple[DraftBatch | None, list[str | None], Any, Any]:
        """The batch's drafts, each row's source (None: no draft), its drafts' node
        probabilities (rows of an array or lists; None when no rule reads them) and supports
        (an array; None without probabilities or where a model source drafted); drafting time
        is measured (less one-off index building) for the gate.

        Occurrence sources (indices, or matches a source found itself) go through the
        longest-match rule and drafting in one compiled call for the batch, which returns the
        batch's padded arrays; a model source's tree is an option of its own beside them."""
        # Kept flat on purpose (over 60 lines): the drafter's per-step hot path, read as one pass over the sources.
        cfg = self.cfg
        B = len(seqs)
        every = range(B)
        rows: list[int] = []  # rows with room to draft, for sources that answer row by row
        if any(not isinstance(src, IndexSource) for src in sources):
            rows = [i for i, c in enumerate(caps) if c > 0]
        options: dict[int, list[Candidate]] = {}
        cols: list[list] = []
        col_sources: list[DraftSource] = []
        indexed = any(isinstance(src, IndexSource) for src in sources)
        t_index = 0.0
        for src in sources:
            t0 = time.perf_counter()
            b0 = src.build_s
            if isinstance(src, IndexSource):
                src.sync()
                cols.append(src.indices(seqs))  # rows with no room are skipped by the core
                col_sources.append(src)
                t_index += time.perf_counter() - t0 - (src.build_s - b0)
                continue
            got = src.propose(seqs, caps, rows)
            col, any_occ = [], False
            for i in every:
                c = got.get(i)
                if c is not None and c.tree is not None:
                    options.setdefault(i, []).append(c)
                    c = None
                col.append(None if c is None else c.occurrences)
                any_occ = any_occ or c is not None
            if any_occ:
                cols.append(col)
                col_sources.append(src)
            self.gate.charge(bucket, src.name, max(0.0, time.perf_counter() - t0 - (src.build_s - b0)))
        batch: DraftBatch | None = None
        names: list[str | None] = [None] * B
        probs: Any = None
        support: Any = None
        if cols:
            t0 = time.perf_counter()
            src_a, len_a, tok_a, par_a, dep_a, probs, support = longest_match_drafts(
                cols, [s.merge_ties for s in col_sources], [s.fallback for s in col_sources],
                [s.output_ids for s in seqs], [s.prompt_ids for s in seqs], caps, cfg.pattern_max,
                cfg.pattern_min, cfg.min_prob, cfg.tree_budget, self._with_probs or bool(options))
            lengths = len_a.tolist()
            if any(lengths):
                batch = DraftBatch(torch.from_numpy(tok_a), torch.from_numpy(par_a), torch.from_numpy(dep_a),
                                   lengths, is_path=cfg.tree_budget == 0)
                col_names = [s.name for s in col_sources]
                names = [col_names[k] if k >= 0 else None for k in src_a.tolist()]
            t_index += time.perf_counter() - t0
        if indexed:
            self.gate.charge(bucket, INDEX, max(0.0, t_index))
        if not options:  # occurrence sources only: each row's draft is its best match's
            return batch, names, probs, support
        drafts: list[DraftTree | None] = list(batch) if batch is not None else [None] * B
        chosen: list = [None] * B
        for i in rows:
            cands = [(names[i], drafts[i], probs[i][:len(drafts[i])].tolist())] if drafts[i] is not None else []
            for c in options.get(i, []):
                n = _prefix_within(c.tree, caps[i], self.cfg.tree_budget)
                if n:
                    cands.append((c.source, _truncate(c.tree, n), c.probs[:n]))
            if not cands:
                drafts[i] = None
                continue
            if self.rule == "best_expected" and len(cands) > 1:
                cands.sort(key=lambda x: -self.calibration(x[0]) * sum(x[2]))
                if self.cfg.tree_budget > 0:
                    # Room for a tree: every source's draft as branches of one tree (verification
                    # takes whichever branch the target draws), best nodes first.
                    tree, pr = union_tree([(t, [self.calibration(src) * q for q in p]) for src, t, p in cands],
                                          self.cfg.tree_budget)
                    cands = [(cands[0][0], tree, pr)]
            drafts[i], chosen[i] = cands[0][1], cands[0]
        return (DraftBatch.from_trees(drafts), [c[0] if c is not None else None for c in chosen],
                [c[2] if c is not None else None for c in chosen], None)

    def row_sources(self) -> list[str | None]:
        """Each row's draft source in the batch ``propose`` just returned (None: no draft)."""
        return list(self._pending.names) if self._pending is not None else []

    def row_probs(self) -> Any:
        """Each row's node probabilities in the batch ``propose`` just returned (a row per row;
        built with ``with_probs``, else None)."""
        return self._pending.probs if self._pending is not None else None

    def row_support(self) -> Any:
        """Each row's node supports (the weight of the continuations the index saw at each
        node's context) in the batch ``propose`` just returned, as :meth:`row_probs`; None
        where a model source drafted."""
        return self._pending.support if self._pending is not None else None

    def observe(self, seqs: list[Sequence], drafted: list[int], accepted: list[int]) -> None:
        if self.gate.resting:  # a quiet step (applied when the gate wakes), or a dormant rollout
            return
        pending, self._pending = self._pending, None
        if pending is None or pending.seqs is not seqs:  # nothing drafted this step (or not this batch)
            self.gate.observe_plain(len(seqs))
            return
        batch, names, probs = pending.batch, pending.names, pending.probs
        succ = fail = 0
        calibrate = self._wants_probs  # the only rule that reads the calibration
        acc_by: Counter[str] = Counter()
        drafted_by: Counter[str] = Counter()
        policy, cap = self.policy, self.cap
        depths = batch.row_depths()
        for b, d in enumerate(drafted):
            if not d:
                continue
            source, a, depth = names[b], accepted[b], depths[b]
            if calibrate:
                self.calibration.update(source, float(sum(probs[b][:d])), a)
            acc_by[source] += a
            drafted_by[source] += d
            # A tree is "fully accepted" when the walk reached its deepest level.
            succ += a
            fail += a < depth
            seq = seqs[b]
            seq.draft_len = policy(seq.draft_len or self.first, depth, a, cap=cap)
        self.accepted_by_source.update(acc_by)
        self.drafted_by_source.update(drafted_by)
        self.gate.observe_drafts(len(seqs), succ, fail, len(seqs) + sum(accepted))

    def observe_time(self, B: int, width: int, seconds: float) -> None:
        """The engine's measured time of one decode step (drafting included); the one-off cost
        of building indices this step is taken out (amortised over the whole rollout)."""
        if self.gate.resting:
            return
        build = 0.0
        for s in self.sources:
            if s.build_s:
                build += s.build_s
                s.build_s = 0.0
        self.gate.observe_time(B, width, seconds, build)

    def on_admit(self, seqs: list[Sequence]) -> None:
        if self.cfg.gate:
            have = tuple(src.name for src in self.sources if src.available(seqs))
            if self.gate.admit(have, self._names):
                return
        for s in self.sources:
            s.on_admit(seqs)

    def on_finish(self, seq: Sequence) -> None:
        if self.gate.dormant:  # admitted while dormant: the sources never saw it
            return
        for s in self.sources:
            s.on_finish(seq)

    def on_abort(self, seq: Sequence) -> None:
        for s in self.sources:
            s.on_abort(seq)

    def load_source_state(self, named: dict[str, Any]) -> None:
        for s in self.sources:
            s.load_state(named)

    def counters(self) -> dict[str, float]:
        return {**{f"accepted/{k}": v for k, v in self.accepted_by_source.items()},
                **{f"drafted/{k}": v for k, v in self.drafted_by_source.items()}}

    # --- checkpoints -------------------------------------------------------------------------
    def gate_state(self) -> dict:
        """What the gate and the selection rule have learnt, as plain data."""
        return {**self.gate.state(), "calibration": sorted(self.calibration.ratio.items())}

    def load_gate_state(self, state: dict) -> None:
        """Inverse of :meth:`gate_state`; a malformed state is ignored with a warning (speed only)."""
        try:
            if not isinstance(state, dict):
                raise TypeError(f"expected a mapping, got {type(state).__name__}")
            calib = {str(k): float(v) for k, v in state.get("calibration", [])}
            self.gate.load_state(state)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("speculation gate state ignored (%s)", e)
            return
        self.calibration.ratio = calib


def union_tree(trees: list[tuple[DraftTree, list[float]]], budget: int) -> tuple[DraftTree, list[float]]:
    """Merge draft trees into one (shared prefixes once; a node keeps its highest probability)
    and keep the ``budget`` most probable nodes. A node is never more probable than its parent
    within a tree, so ordering by probability (then depth) puts parents first."""
    tok: list[int] = []
    par: list[int] = []
    prob: list[float] = []
    depth: list[int] = []
    at: dict[tuple[int, int], int] = {}
    for tree, probs in trees:
        where: list[int] = []
        for t, p, q, d in zip(tree.tokens, tree.parents, probs, tree.depths):
            mp = where[p] if p >= 0 else -1
            j = at.get((mp, t))
            if j is None:
                j = at[(mp, t)] = len(tok)
                tok.append(t)
                par.append(mp)
                prob.append(q)
                depth.append(d)
            else:
                prob[j] = max(prob[j], q)
            where.append(j)
    for j in range(len(tok)):  # a parent is at least as probable as any child it has
        k = par[j]
        while k >= 0 and prob[k] < prob[j]:
            prob[k] = prob[j]
            k = par[k]
    order = sorted(range(len(tok)), key=lambda j: (-prob[j], depth[j], j))[:budget]
    keep = set(order)
    order = [j for j in order if _ancestors_kept(j, par, keep)]
    new = {j: n for n, j in enumerate(order)}
    return (DraftTree(tuple(tok[j] for j in order), tuple(new[par[j]] if par[j] >= 0 else -1 for j in order)),
            [prob[j] for j in order])


def _ancestors_kept(j: int, par: list[int], keep: set[int]) -> bool:
    k = par[j]
    while k >= 0:
        if k not in keep:
            return False
        k = par[k]
    return True


def _prefix_within(tree: DraftTree | None, cap: int, tree_budget: int) -> int:
    """How many of a model tree's nodes fit a row's cap: nodes no deeper than ``cap``, and
    no more than the tree budget (a path's length when trees are off)."""
    if tree is None:
        return 0
    n = 0
    limit = max(tree_budget, cap)
    for d in tree.depths:
        if d > cap or n >= limit:
            break
        n += 1
    return n


def _truncate(d: DraftTree, k: int) -> DraftTree:
    # Nodes are in best-first order with parents first, so any prefix is a valid tree.
    return DraftTree.path(d.tokens[:k]) if d.is_path else DraftTree(d.tokens[:k], d.parents[:k])
