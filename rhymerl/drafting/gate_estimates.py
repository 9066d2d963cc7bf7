"""What the gate measures to decide (:class:`rhymerl.drafting.gate.Gate`): per-token acceptance
(overall and per batch-size bucket), the step's overhead beyond the cost model, and what
drafting really cost per emitted token against plain decoding (with the rule that holds a
source set off where it was dearer)."""
from __future__ import annotations

from dataclasses import dataclass

from rhymerl.engine.cost_model import CostModel

class AcceptanceEstimate:
    """Per-token acceptance probability from (drafted, accepted) pairs, exponentially decayed.

    Each drafted position up to the first rejection is one trial: accepted tokens are
    successes, a rejection is one failure, positions after it are unobserved.
    """

    def __init__(self, prior: float = 0.6, prior_weight: float = 4.0, decay: float = 0.98) -> None:
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.succ, self.fail = prior * prior_weight, (1 - prior) * prior_weight

    def update(self, drafted: list[int], accepted: list[int]) -> None:
        """Decay old evidence toward the prior (so a gate that stopped drafting after a bad
        patch tries again), then add this step's trials."""
        self.add(sum(a for d, a in zip(drafted, accepted) if d), sum(1 for d, a in zip(drafted, accepted) if d and a < d))

    def add(self, successes: float, failures: float) -> None:
        """Decay old evidence toward the prior, then add counted trials."""
        self.relax(1 - self.decay)
        self.succ += successes
        self.fail += failures

    def idle(self, steps: int) -> None:
        """``steps`` steps without drafts at once: the same as ``add(0, 0)`` that many times."""
        self.relax(1 - self.decay**steps)

    def relax(self, frac: float) -> None:
        """Move ``frac`` of the way back to the prior."""
        self.succ += frac * (self.prior * self.prior_weight - self.succ)
        self.fail += frac * ((1 - self.prior) * self.prior_weight - self.fail)

    @property
    def alpha(self) -> float:
        return self.succ / (self.succ + self.fail)


class BucketAcceptance:
    """Acceptance per batch-size bucket (powers of two), read with optimism where little is known.

    Per bucket because a drained tail's rows (the long responses that left their history) accept
    fewer drafts than a full batch, and a gate judged on the tail alone would never draft at the
    full batch again, so never learn otherwise (docs/design.md, "Acceptance per batch size").
    Each bucket's evidence (decayed, halved at each rollout step like the global estimate's)
    is read shrunk toward the global estimate, plus ``z`` standard errors: a bucket with little
    evidence is tried, and one verification at a full batch is evidence enough to settle it."""

    def __init__(self, weight: float = 4.0, z: float = 1.0, decay: float = 0.98) -> None:
        self.weight, self.z, self.decay = weight, z, decay
        # per bucket, evidence alone (no prior: the global estimate is the prior, at read time)
        self.evidence: dict[int, AcceptanceEstimate] = {}

    def _bucket(self, bucket: int) -> AcceptanceEstimate:
        est = self.evidence.get(bucket)
        if est is None:
            est = self.evidence[bucket] = AcceptanceEstimate(prior_weight=0.0, decay=self.decay)
        return est

    def add(self, bucket: int, successes: float, failures: float) -> None:
        self._bucket(bucket).add(successes, failures)

    def relax(self, frac: float) -> None:
        """Forget ``frac`` of every bucket's evidence."""
        for est in self.evidence.values():
            est.relax(frac)

    def alpha(self, bucket: int, overall: float) -> float:
        """The acceptance to plan with at this bucket, given the global estimate ``overall``."""
        est = self.evidence.get(bucket)
        succ, fail = (est.succ, est.fail) if est is not None else (0.0, 0.0)
        n = succ + fail + self.weight
        a = (succ + self.weight * overall) / n
        return min(0.99, a + self.z * (a * (1.0 - a) / n) ** 0.5)

    def state(self) -> list[list[float]]:
        return sorted([b, est.succ, est.fail] for b, est in self.evidence.items())

    def load(self, state: list) -> None:
        self.evidence = {}
        for b, succ, fail in state:
            est = self._bucket(int(b))
            est.succ, est.fail = float(succ), float(fail)


class StepOverhead:
    """How much a step really takes relative to the cost model's forward, for plain and for
    speculative steps (EMA of measured / predicted), per batch-size bucket (powers of two):
    fixed per-step costs weigh more at small batches, so steps are compared like with like.
    The spec/plain ratio is the extra cost of speculating that the forward alone misses."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.plain: dict[int, float] = {}
        self.spec: dict[int, float] = {}

    def update(self, cost: CostModel, B: int, width: int, seconds: float) -> None:
        ratio = seconds / cost.cost(B, width)
        table = self.plain if width <= 1 else self.spec
        b = B.bit_length()
        table[b] = ratio if b not in table else self.decay * table[b] + (1 - self.decay) * ratio

    def relax(self, frac: float) -> None:
        """Move each bucket's speculative ratio ``frac`` of the way to its plain one: a factor
        measured high (a slow patch of the machine) must not keep speculation off for good,
        since a bucket that stops speculating stops measuring it."""
        for b, spec in self.spec.items():
            plain = self.plain.get(b)
            if plain is not None:
                self.spec[b] = spec + frac * (plain - spec)

    def factor(self, B: int) -> float:
        b = B.bit_length()
        if b not in self.plain or b not in self.spec:
            return 1.0
        return max(1.0, self.spec[b] / self.plain[b])


@dataclass(frozen=True)
class HoldRule:
    """How `RealizedCost` judges one source set: on at least ``evidence`` measurements, against
    plain decoding measured in the bucket within its last ``fresh`` steps (None: any), held for
    ``backoff`` steps when dearer, the hold doubling up to ``max_backoff`` while confirmed."""
    evidence: int = 2  # one slow step on a shared machine must not switch off drafting that pays
    backoff: int = 8
    max_backoff: int = 128
    fresh: int | None = None


class RealizedCost:
    """Measured, not predicted: per batch-size bucket, what decode steps really cost per
    emitted token relative to the cost model's plain forward (EMA), for plain steps and for
    steps that drafted with each source set (drafting included).

    The gate's prediction (cost model x acceptance estimate) is least reliable where drafts
    are poor (a prompt's first epoch, a draft model whose forwards cost a real fraction of the
    target's), and "never slower than no speculation" is judged on measured time. So: where a
    source set has measured dearer per token than plain decoding (by ``margin``: 1.0, any loss,
    since never slower is the promise; on the evidence its `HoldRule` asks for), it is held off
    in that bucket for the rule's ``backoff`` of its steps, the hold doubling each time it is
    confirmed (up to ``max_backoff``) and reset when the set measures cheaper. A bucket where
    drafting runs but plain decoding was never measured (or not for ``max_age`` of its steps)
    takes one plain step to measure it. Holds outlast rollout steps (an exploring step is dear),
    except where what a set drafts from has changed (:meth:`lift`: a history source after new
    history was recorded); the next measurement of a lifted set replaces its old one. Plain costs
    are kept."""

    def __init__(self, decay: float = 0.7, max_age: int = 64, margin: float = 1.0,
                 rule: HoldRule = HoldRule()) -> None:
        self.decay, self.max_age, self.margin, self.rule = decay, max_age, margin, rule
        self._count: dict[tuple[int, int], int] = {}  # measurements since the set was (re)started
        self.plain: dict[int, float] = {}
        self.spec: dict[tuple[int, int], float] = {}
        self._age: dict[int, int] = {}  # steps in the bucket since plain decoding was measured there
        self._hold: dict[tuple[int, int], int] = {}
        self._backoff: dict[tuple[int, int], int] = {}
        self._stale: set[tuple[int, int]] = set()
        # The last judgement of each (bucket, set): dearer than plain or not. Only judgements
        # made (enough evidence, a plain measurement fresh enough for the set), for the gate's
        # verdict on a whole rollout (the controller's dormancy).
        self.dearer: dict[tuple[int, int], bool] = {}

    def lift(self, options: set[int]) -> None:
        """What these source sets draft from has changed: hold them no longer, measure afresh."""
        for key in [k for k in self._hold if k[1] in options]:
            del self._hold[key]
        for key in [k for k in self.spec if k[1] in options]:
            self._stale.add(key)
            self.dearer.pop(key, None)
            self._backoff.pop(key, None)
            self._count.pop(key, None)

    def update(self, cost: CostModel, B: int, emitted: int, seconds: float, option: int | None,
               rule: HoldRule | None = None) -> None:
        """One decode step's measurement; ``option`` is the source set that drafted (None: plain),
        judged by ``rule`` (default: this instance's)."""
        if emitted <= 0:
            return
        r = seconds / cost.cost(B, 1) * B / emitted
        b = B.bit_length()
        self._age[b] = self._age.get(b, 0) + 1
        if option is None:
            self.plain[b] = r if b not in self.plain else self.decay * self.plain[b] + (1 - self.decay) * r
            self._age[b] = 0
            return
        key = (b, option)
        if key not in self.spec or key in self._stale:
            self.spec[key] = r
            self._stale.discard(key)
            self._count[key] = 1
        else:
            self.spec[key] = self.decay * self.spec[key] + (1 - self.decay) * r
            self._count[key] = self._count.get(key, 0) + 1
        plain = self.plain.get(b)
        rule = rule or self.rule
        if plain is None or self._count[key] < rule.evidence or (rule.fresh is not None and self._age[b] > rule.fresh):
            return
        self.dearer[key] = self.spec[key] > plain * self.margin
        if self.dearer[key]:
            n = self._backoff.get(key, rule.backoff)
            self._hold[key] = n
            self._backoff[key] = min(rule.max_backoff, 2 * n)
        else:
            self._backoff[key] = rule.backoff

    def needs_plain(self, B: int) -> bool:
        """Whether this step should decode plainly to measure plain decoding in its bucket."""
        b = B.bit_length()
        drafting_here = any(k[0] == b for k in self.spec)
        return drafting_here and (b not in self.plain or self._age.get(b, 0) > self.max_age)

    def skip(self, B: int, steps: int) -> None:
        """``steps`` steps in ``B``'s bucket on which no set was asked (the gate's quiet steps):
        they count toward every hold there, as steps the gate asked on do."""
        b = B.bit_length()
        for key in [k for k in self._hold if k[0] == b]:
            self._hold[key] = max(0, self._hold[key] - steps)

    def allows(self, B: int, option: int) -> bool:
        """Whether source set ``option`` may draft at this batch size; a held call counts down."""
        key = (B.bit_length(), option)
        left = self._hold.get(key, 0)
        if left <= 0:
            return True
        self._hold[key] = left - 1
        return False

    def state(self) -> dict:
        return {"plain": sorted(self.plain.items()), "spec": sorted([b, o, r] for (b, o), r in self.spec.items()),
                "backoff": sorted([b, o, n] for (b, o), n in self._backoff.items()),
                "dearer": sorted([b, o, int(d)] for (b, o), d in self.dearer.items())}

    def load(self, state: dict) -> None:
        self.plain = {int(b): float(r) for b, r in state.get("plain", [])}
        self.spec = {(int(b), int(o)): float(r) for b, o, r in state.get("spec", [])}
        self._backoff = {(int(b), int(o)): int(n) for b, o, n in state.get("backoff", [])}
        self.dearer = {(int(b), int(o)): bool(d) for b, o, d in state.get("dearer", [])}
        self._stale = set(self.spec)
