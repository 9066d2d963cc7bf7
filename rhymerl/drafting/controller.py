"""The speculation controller: the engine's proposer over a set of draft sources.

It owns what is common to every source: the batch gate (draft only what pays on this
machine), each request's adaptive draft length, and the choice of source per request:

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
from typing import Any

import torch

from rhymerl.drafting.config import SpecConfig
from rhymerl.drafting.gate import (AcceptanceEstimate, BucketAcceptance, HoldRule, RealizedCost, StepOverhead, best_width,
                                   uniform_width)
from rhymerl.drafting.length_policy import POLICIES
from rhymerl.drafting.source import Candidate, DraftSource, IndexSource, SourceContext, get_source
from rhymerl.drafting.suffix_index import longest_match_drafts
from rhymerl.engine.cost_model import CostModel
from rhymerl.engine.draft import DraftBatch, DraftTree
from rhymerl.engine.sequence import Sequence

log = logging.getLogger(__name__)
# How measured costs hold source sets off (`RealizedCost`). Index-only sets: judged only against
# plain steps of their bucket's last 8 (the gate is skipping there anyway). Sets that run a model:
# their exploring steps are dear (a draft model's first step at batch 128 cost 3x a plain one),
# so they are judged on one step against any plain measurement, held 32 steps at first and up
# to 1,024 while they keep measuring dearer.
CHEAP_RULE = HoldRule(fresh=8)
MODEL_RULE = HoldRule(evidence=1, backoff=32, max_backoff=1024)
MAX_WAIT = 32  # the longest the gate waits after drafts it threw away (steps)
QUIET = 4  # steps without drafting, at one batch size, after the check before drafting said no
PROBE_EVERY = 4  # where drafting did not pay, one rollout in this many drafts again (to see whether it does now)
MAX_PROBE_EVERY = 32  # ... the period doubling each time a probe finds it still does not pay
UNPAID_SHARE = 0.02  # drafting "did not pay" in a rollout that tried it and got under this share of its tokens
UNPAID_TRIES = 4  # ... from at least this many drafting attempts (fewer: the gate held off, nothing was learnt)
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


class SpecController:
    """A :class:`rhymerl.engine.Proposer` drafting from ``sources`` (built from the config's
    method when not given)."""

    def __init__(self, cfg: SpecConfig | None = None, store=None, *, target=None, target_path: str | None = None,
                 sources: list[DraftSource] | None = None, rule: str | None = None) -> None:
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
        self.rule = rule or "longest_match"
        self._wants_probs = self.rule == "best_expected"  # the only rule that reads drafts' probabilities
        if cfg.length_policy not in POLICIES:
            raise ValueError(f"speculative.length_policy {cfg.length_policy!r} is not one of {sorted(POLICIES)}")
        self.policy, cap = POLICIES[cfg.length_policy]
        self.cap = min(cap, cfg.max_draft)
        self.max_nodes = max(cfg.tree_budget, self.cap)
        for s in sources:
            self.max_nodes = max(self.max_nodes, getattr(s, "max_nodes", 0))
        self.wants_hidden = any(s.wants_hidden for s in sources)
        self.cost_model: CostModel | None = None
        self.acceptance = AcceptanceEstimate()
        self.by_bucket = BucketAcceptance()  # what the gate plans with: per batch size, see there
        self.overhead = StepOverhead()
        # Measured per-token cost of drafting against plain decoding (RealizedCost; kept across
        # rollout steps). Sets that run a model are judged against any plain measurement (one is
        # taken when missing: their exploring steps are dear); index-only sets only against plain
        # steps of the last few in the bucket, where the gate is skipping anyway: a comparison
        # with a stale one (this machine's speed moves by tens of percent) had switched HistoSpec
        # off where it paid.
        self.realized = RealizedCost()
        self._option = 0  # which of _source_sets drafted this step
        self._store_version = getattr(store, "version", None)
        self._emitted = 0  # tokens the last decode step emitted
        self.calibration = Calibration()
        self.step = 0
        self._fill = 1.0  # EMA of drafted length / cap: how full drafts turn out to be
        # Seconds of drafting per step, per (batch-size bucket, source), EMA: the gate charges
        # it before drafting (a draft model's forwards are a real cost on a CPU).
        self.draft_cost: dict[tuple[int, str], float] = {}
        cheap = [s for s in sources if not s.runs_a_model]
        self._source_sets = [sources] + ([cheap] if cheap and len(cheap) < len(sources) else [])
        self._guarded = [any(src.runs_a_model for src in option) for option in self._source_sets]
        self._builders = [src for src in sources if hasattr(src, "build_s")]  # sources that build indices
        self._set_names = [{INDEX if isinstance(src, IndexSource) else src.name for src in option}
                           for option in self._source_sets]  # what each set's drafting time is charged to
        self._draft_s = 0.0  # this step's drafting, kept out of the step-overhead measurement
        # Drafting steps in a row whose drafts the gate then threw away, the batch size when the
        # run began, and steps left to skip drafting for (doubling per discard): where drafts keep
        # coming up too short to pay (a prompt's first epoch), the drafting work is wasted every
        # time. A run is forgotten once the batch has halved since it began (smaller batches
        # verify more cheaply). (Kept per power-of-two bucket before, the drained batch started a
        # new run at 127 rows, after 128's: 9 fruitless tries between 127 and 51 rows a rollout.)
        self._discards = 0
        self._discard_b = 0
        self._wait = 0
        # Quiet steps: where drafting cannot pay (waiting, or for QUIET steps at the batch size
        # where the check before drafting said no) a step does nothing else, and is not
        # measured (observe and observe_time return at once): on the small test model a step
        # is 2 ms, and the per-step bookkeeping was 1-1.5 % of a first epoch's rollout. What
        # each such step would have changed (the drift back of `_skip`, the acceptance
        # estimate's pull to its prior) is applied for all of them when drafting is considered
        # again (`_wake`). Plain decoding's measurement does not age over them: counted as
        # older, it was too old to judge drafting against after a long wait, and drafting that
        # measured dearer than plain was no longer held off (twice the drafting attempts).
        self._quiet = 0
        self._quiet_b = 0  # the batch size the quiet steps hold for
        self._idle = 0  # quiet steps not yet accounted for, at batch sizes in _idle_b's bucket
        self._idle_b = 1
        # This step's batch, its drafts and each drafted row's (source, node probabilities): what
        # observe() reads for the rows verification scored (the engine passes the same list).
        self._pending: tuple[list[Sequence], DraftBatch, list[str | None], Any] | None = None
        # Memory across rollouts. Within one, the gate learns only from its own steps, so a
        # prompt's first epoch (no history of its own: siblings alone draft, and on this
        # machine's measurements they do not pay) paid for the same fruitless exploration in
        # every rollout (17-19 drafting attempts, 2-3 % of it at batch 64). Which sources have
        # anything to offer (their `available`) is the rollout's situation; where drafting did
        # not pay in the last rollout that tried it in the same situation, a rollout is dormant
        # (no drafting and no source bookkeeping, as if speculation were off) except one in
        # PROBE_EVERY (or more, see _period), which tries again.
        self._unpaid: dict[tuple[str, ...], int] = {}  # situation -> dormant rollouts since it was last tried
        # situation -> one rollout in this many probes. Doubled by each probe that finds drafting
        # still unpaid: a probe is dear (a draft model explores every batch size again: 3-22 % of
        # a rollout at batch 64 here), and at a fixed one in four it cost 1-5 % on average.
        self._period: dict[tuple[str, ...], int] = {}
        self._situation: tuple[str, ...] | None = None  # this rollout's, from what was admitted
        self._dormant = False
        self._verified: Counter[tuple[int, int]] = Counter()  # this rollout's verifications per (bucket, source set)
        self._tries = 0  # this rollout's drafting attempts, decoded rows and accepted tokens
        self._rows = 0
        self._accepted = 0
        self.accepted_by_source: Counter[str] = Counter()
        self.drafted_by_source: Counter[str] = Counter()

    # --- engine hooks -----------------------------------------------------------------
    @property
    def wants_cost_model(self) -> bool:
        return self.cfg.gate

    def attach_cost_model(self, cost: CostModel) -> None:
        self.cost_model = cost

    def begin(self, step: int) -> None:
        """A new rollout step: the history may have changed, so the acceptance estimate is
        pulled halfway back to its prior and full drafts are expected again. (Relaxing only
        when the store changed was tried: it kept the pessimism of a warm-up call and cost
        15 % of tokens per forward in `bench spec`, for no gain in a first epoch.)

        What a speculative step costs beyond its forward is the engine's and this machine's,
        not the history's: it is kept, pulled halfway back to plain. (Measured afresh each
        rollout step, the first verifications in each batch-size bucket were judged at the
        forward's cost alone, about half of what they cost at the drained tail's batch of 4:
        in a first epoch 6.7 fruitless verifications a rollout instead of 0.9, 1 % of its time.)"""
        self.step = step
        self._settle()
        self._wake()
        self._quiet = 0
        self.overhead.relax(0.5)
        self._fill = max(self._fill, 0.5)
        self._discards = self._wait = 0  # drafts may pay again from a new step's history
        self.acceptance.relax(0.5)
        self.by_bucket.relax(0.5)
        version = getattr(self.store, "version", None)
        if version != self._store_version:  # new history: sets that read it may pay now
            self._store_version = version
            self.realized.lift({n for n, option in enumerate(self._source_sets)
                                if any(getattr(src, "store", None) is not None for src in option)})
        for s in self.sources:
            s.begin(step)

    def propose(self, seqs: list[Sequence]) -> DraftBatch | None:
        self._draft_s = 0.0
        if self._dormant:
            return None
        cfg = self.cfg
        B = len(seqs)
        bucket = B.bit_length()
        self._rows += B
        if cfg.gate:  # quiet steps first: the cheapest there are
            if self._discards and 2 * B <= self._discard_b:
                self._discards = self._wait = 0
            if self._wait > 0:
                self._wait -= 1
                return self._rest(B)
            if self._quiet > 0 and B == self._quiet_b:
                self._quiet -= 1
                return self._rest(B)
            if self._idle:
                self._wake()
        alpha = self.by_bucket.alpha(bucket, self.acceptance.alpha)
        over = self.overhead.factor(B)
        # Before drafting anything: would drafts as full as they have recently been pay at this
        # batch size, the drafting itself (as long as each source recently took here) included,
        # and up to how many tokens? First with every source, then without the ones that run a
        # model (the cheap index sources may pay where a draft model's forwards do not). Skip
        # the drafting work that cannot pay. Every row at the full cap first (no per-row work:
        # this check runs every step, and a step that skips must cost next to nothing), then
        # the rows' own caps.
        sources, k_pre = self.sources, self.cap
        self._option = 0
        if cfg.gate:
            if any(self._guarded) and self.realized.needs_plain(B):
                return None  # one plain step, to measure what drafting is compared with
            full = round(self.cap * self._fill)
            for n, option in enumerate(self._source_sets):
                if not self.realized.allows(B, n):
                    continue
                k_pre = uniform_width(self.cost_model, B, full, alpha, self.cap, over, self._draft_seconds(bucket, n))
                if k_pre:
                    sources, self._option = option, n
                    break
            else:
                self._quiet, self._quiet_b = QUIET, B
                return self._skip(bucket)
        self._tries += 1
        t0 = time.perf_counter()
        cap = min(self.cap, k_pre)
        # Each row's draft length within the cap and the room it has left (comparisons, not
        # min/max calls: this runs on every row of every drafting step, 4x faster this way).
        caps = [0 if room <= 0 else (d if d < room else room)
                for s in seqs
                for d, room in (((s.draft_len or 2) if (s.draft_len or 2) < cap else cap,
                                 s.limit - len(s.output_ids) - 1),)]
        batch, names, probs = self._draft(seqs, caps, sources, bucket)
        self._draft_s = time.perf_counter() - t0
        lengths = batch.lengths if batch is not None else [0] * B
        total = sum(caps)
        if total:
            self._fill = 0.8 * self._fill + 0.2 * min(1.0, sum(lengths) / total)
        k = best_width(self.cost_model, lengths, alpha, self.max_nodes, over) if cfg.gate else self.max_nodes
        if k == 0 or batch is None:
            # The drafts found do not pay: expect less next time, so that the check above skips
            # the drafting work until drafts may have grown (it drifts back up), and wait before
            # drafting again from the second time in a row on, twice as long each time (one
            # discard is common where drafts pay; a run of them is not).
            self._fill *= 0.5
            if not self._discards:
                self._discard_b = B
            n = self._discards = self._discards + 1
            if n >= 2:
                self._wait = min(MAX_WAIT, 1 << (n - 2))
            return None
        self._discards = 0
        batch = batch.truncated(k)
        self._pending = (seqs, batch, names, probs)
        return batch

    def _settle(self) -> None:
        """The rollout that ended: remember whether drafting paid in its situation."""
        sit, self._situation = self._situation, None
        if sit is not None and not self._dormant:
            # The share needs a few attempts to mean anything; "dearer" is RealizedCost's verdict
            # and needs none here (where a model's tries are held long, a rollout makes 1-3 of
            # them, and with UNPAID_TRIES required it never slept: each rollout paid 2-5 %).
            tried = self._tries >= UNPAID_TRIES
            if (tried and self._accepted < UNPAID_SHARE * (self._rows + self._accepted)) or self._dearer():
                # a situation already marked was probed (or woken by a later admission): confirmed
                period = self._period.get(sit, PROBE_EVERY)
                self._period[sit] = min(MAX_PROBE_EVERY, 2 * period) if sit in self._unpaid else PROBE_EVERY
                self._unpaid[sit] = 0
            elif tried:
                self._unpaid.pop(sit, None)
                self._period.pop(sit, None)
        self._dormant = False
        self._tries = self._rows = self._accepted = 0
        self._verified.clear()

    def _dearer(self) -> bool:
        """Whether most of this rollout's verifications by source sets that run a model (counted
        per (bucket, set)) were where `RealizedCost` last judged drafting dearer per token than
        plain decoding: drafts that were accepted but did not pay for their time (a draft
        model's forwards on a CPU). A majority, not "every bucket": a draft model breaks even at
        one row here, and a rollout whose few tries included one such step was never judged, so
        it probed every fourth rollout at 3-7 % of that rollout's time. The cheap index sources
        are left to the per-bucket holds: a whole rollout put to sleep on their verdicts cost
        the main job three rollouts of 3 tokens per forward, twice in two runs) and count as
        paying here: a hybrid whose index sources verify most of its drafts stays awake."""
        dear = total = 0
        for key, n in self._verified.items():
            if not self._guarded[key[1]]:
                total += n
            elif key in self.realized.dearer:
                total += n
                dear += n if self.realized.dearer[key] else 0
        return total > 0 and 2 * dear > total

    def _enter(self, seqs: list[Sequence]) -> None:
        """Sequences were admitted: this rollout's situation, and whether it sleeps. The first
        admission decides; a later one with more sources available may wake it (never the
        reverse: sources that saw a sequence admitted must see it finish)."""
        have = tuple(src.name for src in self.sources if src.available(seqs))
        if self._situation is None:
            self._situation = have
        elif not set(have) - set(self._situation):
            return
        else:
            self._situation = tuple(src.name for src in self.sources
                                    if src.name in have or src.name in self._situation)
            if not self._dormant:
                return
        slept = self._unpaid.get(self._situation)
        self._dormant = slept is not None and slept + 1 < self._period.get(self._situation, PROBE_EVERY)
        if slept is not None:
            self._unpaid[self._situation] = slept + 1 if self._dormant else 0

    def _skip(self, bucket: int, steps: int = 1) -> None:
        """No drafts for ``steps`` steps. Drift back (fuller drafts, cheaper drafting), so that
        skipping is not permanent: a cost measured once, when drafting was slow, must not
        switch it off for good."""
        keep = 0.95**steps
        self._fill = 1.0 - (1.0 - self._fill) * keep
        for key in [k for k in self.draft_cost if k[0] == bucket]:
            self.draft_cost[key] *= keep
        return None

    def _rest(self, B: int) -> None:
        """A quiet step at batch size ``B`` (see ``_quiet``)."""
        if self._idle and B.bit_length() != self._idle_b.bit_length():
            self._wake()
        self._idle += 1
        self._idle_b = B
        return None

    def _wake(self) -> None:
        """Account for the quiet steps since the last one that was not."""
        n, self._idle = self._idle, 0
        if n:
            self._skip(self._idle_b.bit_length(), n)
            self.acceptance.idle(n)
            self.realized.skip(self._idle_b, n)  # holds are in steps, quiet ones too

    def _draft_seconds(self, bucket: int, option: int) -> float:
        """Recent drafting time of source set ``option`` at this batch size (the index sources as one)."""
        cost = self.draft_cost
        return sum(cost.get((bucket, n), 0.0) for n in self._set_names[option])

    def _charge(self, bucket: int, name: str, seconds: float) -> None:
        old = self.draft_cost.get((bucket, name))
        self.draft_cost[(bucket, name)] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def _draft(self, seqs: list[Sequence], caps: list[int], sources: list[DraftSource],
               bucket: int) -> tuple[DraftBatch | None, list[str | None], Any]:
        """The batch's drafts, each row's source (None: no draft) and its drafts' node
        probabilities (rows of an array or lists; None when no rule reads them); drafting time
        is measured (less one-off index building) for the gate.

        Occurrence sources (indices, or matches a source found itself) go through the
        longest-match rule and drafting in one compiled call for the batch, which returns the
        batch's padded arrays; a model source's tree is an option of its own beside them."""
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
            b0 = getattr(src, "build_s", 0.0)
            if isinstance(src, IndexSource):
                src.sync()
                cols.append(src.indices(seqs))  # rows with no room are skipped by the core
                col_sources.append(src)
                t_index += time.perf_counter() - t0 - (getattr(src, "build_s", 0.0) - b0)
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
            self._charge(bucket, src.name, max(0.0, time.perf_counter() - t0 - (getattr(src, "build_s", 0.0) - b0)))
        batch: DraftBatch | None = None
        names: list[str | None] = [None] * B
        probs: Any = None
        if cols:
            t0 = time.perf_counter()
            src_a, len_a, tok_a, par_a, dep_a, probs = longest_match_drafts(
                cols, [s.merge_ties for s in col_sources], [s.fallback for s in col_sources],
                [s.output_ids for s in seqs], [s.prompt_ids for s in seqs], caps, cfg.pattern_max,
                cfg.pattern_min, cfg.min_prob, cfg.tree_budget, self._wants_probs or bool(options))
            lengths = len_a.tolist()
            if any(lengths):
                batch = DraftBatch(torch.from_numpy(tok_a), torch.from_numpy(par_a), torch.from_numpy(dep_a),
                                   lengths, is_path=cfg.tree_budget == 0)
                col_names = [s.name for s in col_sources]
                names = [col_names[k] if k >= 0 else None for k in src_a.tolist()]
            t_index += time.perf_counter() - t0
        if indexed:
            self._charge(bucket, INDEX, max(0.0, t_index))
        if not options:  # occurrence sources only: each row's draft is its best match's
            return batch, names, probs
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
                [c[2] if c is not None else None for c in chosen])

    def observe(self, seqs: list[Sequence], drafted: list[int], accepted: list[int]) -> None:
        if self._idle or self._dormant:  # a quiet step (accounted for by _wake), or a dormant rollout
            return
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is not seqs:  # nothing drafted this step (or not this batch)
            self._emitted = len(seqs)
            self.acceptance.add(0, 0)
            return
        _, batch, names, probs = pending
        self._emitted = len(seqs) + sum(accepted)
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
            seq.draft_len = policy(seq.draft_len or 2, depth, a, cap=cap)
        self.accepted_by_source.update(acc_by)
        self.drafted_by_source.update(drafted_by)
        self.acceptance.add(succ, fail)
        self.by_bucket.add(len(seqs).bit_length(), succ, fail)
        self._accepted += succ

    def observe_time(self, B: int, width: int, seconds: float) -> None:
        """The engine's measured time of one decode step (drafting included), less the
        one-off cost of building indices this step (amortised over the whole rollout)."""
        if self._idle or self._dormant:  # a quiet step or a dormant rollout: not measured
            return
        build = 0.0
        for s in self._builders:
            build += s.build_s
            s.build_s = 0.0
        if self.cost_model is not None:
            # Index building is a one-off, amortised over the rollout; drafting is this step's cost.
            drafted = self._draft_s > 0
            if width > 1:
                self._verified[(B.bit_length(), self._option)] += 1
            dear = drafted and self._guarded[self._option]  # a model's tries: judged at once, held longer
            self.realized.update(self.cost_model, B, self._emitted, max(1e-9, seconds - build),
                                 self._option if drafted else None, MODEL_RULE if dear else CHEAP_RULE)
        seconds = max(1e-9, seconds - max(build, self._draft_s))  # drafting is charged on its own
        if self.cost_model is not None:
            self.overhead.update(self.cost_model, B, width, seconds)

    def on_admit(self, seqs: list[Sequence]) -> None:
        if self.cfg.gate:
            self._enter(seqs)
            if self._dormant:
                return
        for s in self.sources:
            s.on_admit(seqs)

    def on_finish(self, seq: Sequence) -> None:
        if self._dormant:  # admitted while dormant: the sources never saw it
            return
        for s in self.sources:
            s.on_finish(seq)

    def on_abort(self, seq: Sequence) -> None:
        for s in self.sources:
            s.on_abort(seq)

    def load_source_state(self, named: dict[str, Any]) -> None:
        for s in self.sources:
            if hasattr(s, "load_state"):
                s.load_state(named)

    # --- the gate's state, for checkpoints ------------------------------------------------
    def gate_state(self) -> dict:
        """What the gate has learnt (acceptance, measured overheads, draft fill, and the cost
        model measured at start-up), as plain data: a resumed run drafts as this one would."""
        self._wake()
        return {"acceptance": [self.acceptance.succ, self.acceptance.fail],
                "by_bucket": self.by_bucket.state(),
                "overhead": {"plain": sorted(self.overhead.plain.items()), "spec": sorted(self.overhead.spec.items())},
                "fill": self._fill,
                "calibration": sorted(self.calibration.ratio.items()),
                "draft_cost": sorted([b, n, v] for (b, n), v in self.draft_cost.items()),
                "realized": self.realized.state(),
                "unpaid": sorted([list(sit), n, self._period.get(sit, PROBE_EVERY)]
                                 for sit, n in self._unpaid.items()),
                "rollout": [None if self._situation is None else list(self._situation), self._dormant,
                            self._tries, self._rows, self._accepted,
                            sorted([b, o, n] for (b, o), n in self._verified.items())],
                "cost": sorted([b, t, c] for (b, t), c in self.cost_model.table.items())
                if self.cost_model is not None else None}

    def load_gate_state(self, state: dict) -> None:
        """Inverse of :meth:`gate_state`; a malformed state is ignored with a warning (speed only)."""
        try:
            succ, fail = (float(x) for x in state["acceptance"])
            by_bucket = BucketAcceptance()
            by_bucket.load(state.get("by_bucket", []))
            plain = {int(b): float(r) for b, r in state["overhead"]["plain"]}
            spec = {int(b): float(r) for b, r in state["overhead"]["spec"]}
            fill = float(state["fill"])
            calib = {str(k): float(v) for k, v in state.get("calibration", [])}
            dcost = {(int(b), str(n)): float(v) for b, n, v in state.get("draft_cost", [])}
            realized = RealizedCost()
            realized.load(state.get("realized", {}))
            unpaid = {tuple(str(x) for x in e[0]): (int(e[1]), int(e[2]) if len(e) > 2 else PROBE_EVERY)
                      for e in state.get("unpaid", [])}
            sit, dormant, tries, rows, accepted, verified = state.get("rollout", [None, False, 0, 0, 0, []])
            sit = None if sit is None else tuple(str(x) for x in sit)
            dormant, tries, rows, accepted = bool(dormant), int(tries), int(rows), int(accepted)
            verified = Counter({(int(e[0]), int(e[1])): int(e[2]) if len(e) > 2 else 1 for e in verified})
            cost = None if state.get("cost") is None else \
                CostModel({(int(b), int(t)): float(c) for b, t, c in state["cost"]})
        except (KeyError, TypeError, ValueError) as e:
            log.warning("speculation gate state ignored (%s)", e)
            return
        self.acceptance.succ, self.acceptance.fail = succ, fail
        self.by_bucket = by_bucket
        self.overhead.plain, self.overhead.spec = plain, spec
        self._fill = fill
        self.calibration.ratio = calib
        self.draft_cost = dcost
        self.realized = realized
        self._unpaid = {sit: n for sit, (n, _) in unpaid.items()}
        self._period = {sit: period for sit, (_, period) in unpaid.items()}
        self._situation, self._dormant, self._tries, self._rows, self._accepted = sit, dormant, tries, rows, accepted
        self._verified = verified
        if cost is not None and self.cost_model is not None:
            self.cost_model = cost


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
