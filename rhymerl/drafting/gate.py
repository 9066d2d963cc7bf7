"""Batch-level speculation gate: draft only as many tokens per row as pay on this machine.
The widths it verifies are :mod:`rhymerl.drafting.draft_width`'s; what it measures to decide is
:mod:`rhymerl.drafting.gate_estimates`'s; this module is the gate's state machine.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rhymerl.drafting.draft_width import best_width, uniform_width
from rhymerl.drafting.gate_estimates import AcceptanceEstimate, BucketAcceptance, HoldRule, RealizedCost, StepOverhead
from rhymerl.engine.cost_model import CostModel

# How measured costs hold source sets off (RealizedCost). Index-only sets are judged only
# against plain steps of their bucket's last 8; sets that run a model are judged on one step
# against any plain measurement and held long (their exploring steps are dear).
CHEAP_RULE = HoldRule(fresh=8)
MODEL_RULE = HoldRule(evidence=1, backoff=32, max_backoff=1024)
MAX_WAIT = 32  # the longest the gate waits after drafts it threw away (steps)
QUIET = 4  # steps without drafting, at one batch size, after the check before drafting said no
PROBE_EVERY = 4  # where drafting did not pay, one rollout in this many drafts again (to see whether it does now)
MAX_PROBE_EVERY = 32  # ... the period doubling each time a probe finds it still does not pay
UNPAID_SHARE = 0.02  # drafting "did not pay" in a rollout that tried it and got under this share of its tokens
UNPAID_TRIES = 4  # ... from at least this many drafting attempts (fewer: the gate held off, nothing was learnt)


@dataclass(frozen=True)
class GateChoice:
    """What the gate allows this step, before any drafting: which source set drafts (an index
    into the controller's sets; 0 is every source) and the most tokens per row that may pay."""
    option: int
    cap: int


class Gate:
    """Draft only what pays on this machine, judged per batch: the gate of one proposer.

    Its interface is four calls a step and its state: :meth:`choose` (before drafting: may any
    source set draft, and up to how many tokens?), :meth:`judge` (the drafts found: how wide
    to verify, 0 for not at all), :meth:`observe_drafts` / :meth:`observe_plain` and
    :meth:`observe_time` (what verification accepted and what the step cost), and
    :meth:`admit` / :meth:`begin` at a rollout's edges; :meth:`state` / :meth:`load_state`
    for checkpoints. Speed only: it never changes which tokens come out.

    Its rules, each in a line (docs/design.md, "The gate", says how they were found):
    - predicted: the cost model x the acceptance per batch-size bucket x how full drafts have
      recently been (``_fill``) x each set's recent drafting time decide before any drafting;
      the drafts found then get :func:`best_width`;
    - measured: :class:`RealizedCost` holds a set off where it measured dearer per token than
      plain decoding;
    - quiet: where the check before drafting said no, the next QUIET steps at that batch size
      do nothing at all (their bookkeeping is applied at once when drafting is considered again);
      drafts thrown away twice in a row make it wait, twice as long each time (up to MAX_WAIT);
    - dormant: a rollout whose situation (which sources have anything to offer) did not pay in
      the last rollout that tried it drafts nothing, except one in PROBE_EVERY (doubling up to
      MAX_PROBE_EVERY while probes confirm it).
    """

    def __init__(self, *, enabled: bool, cap: int, max_nodes: int, set_names: list[set[str]],
                 runs_model: list[bool], reads_history: list[bool]) -> None:
        self.enabled, self.cap, self.max_nodes = enabled, cap, max_nodes
        self._set_names = set_names  # per source set: the names its drafting time is charged to
        self._guarded = runs_model  # per source set: whether it runs a model (judged at once, held longer)
        self._reads_history = reads_history  # per source set: whether new history may change its verdict
        self.cost_model: CostModel | None = None
        self.acceptance = AcceptanceEstimate()
        self.by_bucket = BucketAcceptance()  # what the gate plans with: per batch size
        self.overhead = StepOverhead()
        self.realized = RealizedCost()
        self.draft_cost: dict[tuple[int, str], float] = {}  # (bucket, name) -> seconds of drafting per step, EMA
        self._fill = 1.0  # EMA of drafted length / cap
        self._option = 0  # the source set that drafted this step
        self._alpha = self.acceptance.alpha  # this step's planned acceptance and overhead factor
        self._over = 1.0
        self._draft_s = 0.0  # this step's drafting time, kept out of the step-overhead measurement
        self._emitted = 0  # tokens the last decode step emitted
        # Discards: drafting steps in a row whose drafts were thrown away, the batch size the run
        # began at (forgotten once the batch has halved), and steps left to wait.
        self._discards = 0
        self._discard_b = 0
        self._wait = 0
        # Quiet steps at batch size _quiet_b still to come, and those not yet accounted for
        # (``_idle``, at batch sizes in _idle_b's bucket): see _rest and _wake.
        self._quiet = 0
        self._quiet_b = 0
        self._idle = 0
        self._idle_b = 1
        # Memory across rollouts: situation -> dormant rollouts since it was last tried, and
        # its probe period; this rollout's situation, verdict and counts.
        self._unpaid: dict[tuple[str, ...], int] = {}
        self._period: dict[tuple[str, ...], int] = {}
        self._situation: tuple[str, ...] | None = None
        self._dormant = False
        self._verified: Counter[tuple[int, int]] = Counter()  # verifications per (bucket, source set)
        self._tries = 0
        self._rows = 0
        self._accepted = 0

    @property
    def dormant(self) -> bool:
        """This rollout drafts nothing (and its sources keep no books)."""
        return self._dormant

    @property
    def resting(self) -> bool:
        """This step is a quiet one or the rollout is dormant: nothing is measured."""
        return bool(self._idle) or self._dormant

    # --- a rollout's edges -----------------------------------------------------------------
    def begin(self, history_changed: bool) -> None:
        """A new rollout: judge the last one, then relax what was learnt halfway toward the
        priors (acceptance, the speculative overhead, how full drafts are), since a new
        step's history may draft better; sets that read a changed history are measured afresh."""
        self._settle()
        self._wake()
        self._quiet = 0
        self.overhead.relax(0.5)
        self._fill = max(self._fill, 0.5)
        self._discards = self._wait = 0
        self.acceptance.relax(0.5)
        self.by_bucket.relax(0.5)
        if history_changed:
            self.realized.lift({n for n, reads in enumerate(self._reads_history) if reads})

    def admit(self, have: tuple[str, ...], order: tuple[str, ...]) -> bool:
        """Sequences were admitted, and ``have`` names the sources with something to offer them
        (``order``: every source's name). The first admission sets the rollout's situation and
        whether it sleeps; a later one with more sources may wake it, never the reverse (sources
        that saw a sequence admitted must see it finish). Returns whether the rollout is dormant."""
        if self._situation is None:
            self._situation = have
        elif not set(have) - set(self._situation):
            return self._dormant
        else:
            self._situation = tuple(n for n in order if n in have or n in self._situation)
            if not self._dormant:
                return False
        slept = self._unpaid.get(self._situation)
        self._dormant = slept is not None and slept + 1 < self._period.get(self._situation, PROBE_EVERY)
        if slept is not None:
            self._unpaid[self._situation] = slept + 1 if self._dormant else 0
        return self._dormant

    # --- one decode step -------------------------------------------------------------------
    def choose(self, B: int) -> GateChoice | None:
        """Before drafting: whether drafts as full as they have recently been would pay at this
        batch size, their drafting time included, first with every source, then with the
        cheap (index) sources alone; None: no drafting this step. Quiet steps come first and
        cost next to nothing."""
        self._draft_s = 0.0
        if self._dormant:
            return None
        bucket = B.bit_length()
        self._rows += B
        if self.enabled:
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
        self._alpha = self.by_bucket.alpha(bucket, self.acceptance.alpha)
        self._over = self.overhead.factor(B)
        k_pre = self.cap
        self._option = 0
        if self.enabled:
            if self.realized.needs_plain(B):
                # One plain step, to measure what drafting is compared with: at a full batch the
                # gate may never skip, and an unmeasured plain step hid a 1.4x dearer verify.
                return None
            full = round(self.cap * self._fill)
            for n in range(len(self._set_names)):
                if not self.realized.allows(B, n):
                    continue
                k_pre = uniform_width(self.cost_model, B, full, self._alpha, self.cap, self._over,
                                      self._draft_seconds(bucket, n))
                if k_pre:
                    self._option = n
                    break
            else:
                self._quiet, self._quiet_b = QUIET, B
                return self._skip(bucket)
        self._tries += 1
        return GateChoice(self._option, min(self.cap, k_pre))

    def charge(self, bucket: int, name: str, seconds: float) -> None:
        """Drafting time of source ``name`` at this batch-size bucket, this step."""
        old = self.draft_cost.get((bucket, name))
        self.draft_cost[(bucket, name)] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def judge(self, lengths: list[int], room: int, draft_s: float, found: bool) -> int:
        """The drafts found (``lengths`` per row, out of ``room`` tokens asked for, in
        ``draft_s`` seconds): how many nodes per row to verify, 0 for none. Drafts that do not
        pay lower the expected fill (the check before drafting then skips until it drifts back
        up) and, from the second time in a row, make the gate wait."""
        B = len(lengths)
        self._draft_s = draft_s
        if room:
            self._fill = 0.8 * self._fill + 0.2 * min(1.0, sum(lengths) / room)
        k = best_width(self.cost_model, lengths, self._alpha, self.max_nodes, self._over) \
            if self.enabled else self.max_nodes
        if k == 0 or not found:
            self._fill *= 0.5
            if not self._discards:
                self._discard_b = B
            n = self._discards = self._discards + 1
            if n >= 2:
                self._wait = min(MAX_WAIT, 1 << (n - 2))
            return 0
        self._discards = 0
        return k

    def observe_plain(self, B: int) -> None:
        """A step verified no drafts."""
        self._emitted = B
        self.acceptance.add(0, 0)

    def observe_drafts(self, B: int, succ: int, fail: int, emitted: int) -> None:
        """A step verified drafts: ``succ`` accepted tokens, ``fail`` rows stopped short of
        their draft's depth, ``emitted`` tokens in all."""
        self._emitted = emitted
        self.acceptance.add(succ, fail)
        self.by_bucket.add(B.bit_length(), succ, fail)
        self._accepted += succ

    def observe_time(self, B: int, width: int, seconds: float, build: float) -> None:
        """A decode step's measured time, drafting included, less ``build`` seconds of one-off
        index building (amortised over the rollout, not this step's cost)."""
        if self.cost_model is not None:
            drafted = self._draft_s > 0
            if width > 1:
                self._verified[(B.bit_length(), self._option)] += 1
            dear = drafted and self._guarded[self._option]
            self.realized.update(self.cost_model, B, self._emitted, max(1e-9, seconds - build),
                                 self._option if drafted else None, MODEL_RULE if dear else CHEAP_RULE)
        seconds = max(1e-9, seconds - max(build, self._draft_s))  # drafting is charged on its own
        if self.cost_model is not None:
            self.overhead.update(self.cost_model, B, width, seconds)

    # --- inside -----------------------------------------------------------------------------
    def _settle(self) -> None:
        """The rollout that ended: remember whether drafting paid in its situation (too few
        tokens accepted from enough attempts, or mostly verified where it measured dearer)."""
        sit, self._situation = self._situation, None
        if sit is not None and not self._dormant:
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
        """Whether most of this rollout's verifications by sets that run a model were where
        RealizedCost last judged them dearer per token than plain decoding (a majority, not
        every bucket). Index-only sets are left to the per-bucket holds and count as paying."""
        dear = total = 0
        for key, n in self._verified.items():
            if not self._guarded[key[1]]:
                total += n
            elif key in self.realized.dearer:
                total += n
                dear += n if self.realized.dearer[key] else 0
        return total > 0 and 2 * dear > total

    def _skip(self, bucket: int, steps: int = 1) -> None:
        """No drafts for ``steps`` steps: drift back (fuller drafts, cheaper drafting), so that
        a cost measured once, when drafting was slow, never switches it off for good."""
        keep = 0.95**steps
        self._fill = 1.0 - (1.0 - self._fill) * keep
        for key in [k for k in self.draft_cost if k[0] == bucket]:
            self.draft_cost[key] *= keep
        return None

    def _rest(self, B: int) -> None:
        """A quiet step at batch size ``B``: nothing but a count."""
        if self._idle and B.bit_length() != self._idle_b.bit_length():
            self._wake()
        self._idle += 1
        self._idle_b = B
        return None

    def _wake(self) -> None:
        """Apply the quiet steps since the last one that was not, as if each had been a step."""
        n, self._idle = self._idle, 0
        if n:
            self._skip(self._idle_b.bit_length(), n)
            self.acceptance.idle(n)
            self.realized.skip(self._idle_b, n)  # holds are in steps, quiet ones too

    def _draft_seconds(self, bucket: int, option: int) -> float:
        """Recent drafting time of source set ``option`` at this batch size."""
        cost = self.draft_cost
        return sum(cost.get((bucket, n), 0.0) for n in self._set_names[option])

    # --- checkpoints ------------------------------------------------------------------------
    def state(self) -> dict:
        """What the gate has learnt, as plain data: a resumed run drafts as this one would."""
        self._wake()
        return {"acceptance": [self.acceptance.succ, self.acceptance.fail],
                "by_bucket": self.by_bucket.state(),
                "overhead": {"plain": sorted(self.overhead.plain.items()), "spec": sorted(self.overhead.spec.items())},
                "fill": self._fill,
                "draft_cost": sorted([b, n, v] for (b, n), v in self.draft_cost.items()),
                "realized": self.realized.state(),
                "unpaid": sorted([list(sit), n, self._period.get(sit, PROBE_EVERY)]
                                 for sit, n in self._unpaid.items()),
                "rollout": [None if self._situation is None else list(self._situation), self._dormant,
                            self._tries, self._rows, self._accepted,
                            sorted([b, o, n] for (b, o), n in self._verified.items())],
                "cost": sorted([b, t, c] for (b, t), c in self.cost_model.table.items())
                if self.cost_model is not None else None}

    def load_state(self, state: dict) -> None:
        """Inverse of :meth:`state`. Malformed input raises KeyError, TypeError or ValueError
        before anything is changed."""
        succ, fail = (float(x) for x in state["acceptance"])
        by_bucket = BucketAcceptance()
        by_bucket.load(state.get("by_bucket", []))
        plain = {int(b): float(r) for b, r in state["overhead"]["plain"]}
        spec = {int(b): float(r) for b, r in state["overhead"]["spec"]}
        fill = float(state["fill"])
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
        self.acceptance.succ, self.acceptance.fail = succ, fail
        self.by_bucket = by_bucket
        self.overhead.plain, self.overhead.spec = plain, spec
        self._fill = fill
        self.draft_cost = dcost
        self.realized = realized
        self._unpaid = {sit: n for sit, (n, _) in unpaid.items()}
        self._period = {sit: period for sit, (_, period) in unpaid.items()}
        self._situation, self._dormant, self._tries, self._rows, self._accepted = sit, dormant, tries, rows, accepted
        self._verified = verified
        if cost is not None and self.cost_model is not None:
            self.cost_model = cost
