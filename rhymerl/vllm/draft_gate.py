"""Whether drafting pays on this vLLM engine, decided step by step (the native gate's idea,
fitted to what a ``custom_class`` proposer can see of vLLM's step).

A step that verifies ``D`` drafted tokens beside its ``B`` rows costs ``c0 + c1 * (B + D)``
seconds (fitted online from the time between consecutive ``propose`` calls) plus the
proposer's own time, and emits ``B + alpha * D`` tokens, ``alpha`` the accepted share of drafted
tokens (measured). Drafting pays when its tokens per second beat plain decoding's:

    (B + alpha * D) / (c0 + c1 * (B + D) + P) > B / (c0 + c1 * B)

On a compute-bound engine (a CPU, a large GPU batch) ``c1`` is large and only drafts that are
mostly accepted pay; where steps are dominated by fixed costs (a drained tail, a GPU's memory-bound
decode) almost any draft does. Until the cost line is measured it drafts on every other step (both
widths seen), and while it declines it drafts on one step in ``probe_every``, so ``alpha`` and the
line stay current.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftGate:
    decay: float = 0.95  # weight of past steps in the fits (about the last 20 steps)
    probe_every: int = 8  # while declining, draft on one step in this many
    warmup: int = 8  # steps (alternating) before the first decision
    alpha: float = 0.5  # accepted share of drafted tokens (a prior until measured)
    drafting: bool = True
    steps: int = 0
    _since_draft: int = 0
    # decayed sums of (tokens scored x, step seconds y) for the cost line y = c0 + c1 x
    _n: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0
    _propose_s: float = 0.0  # the proposer's own time on drafting steps (EMA)
    _drafted_per_row: float = 2.0  # EMA

    def observe_step(self, scored_tokens: int, seconds: float) -> None:
        """One vLLM step's time (without the proposer's) and the tokens it scored."""
        d = self.decay
        self._n = d * self._n + 1
        self._sx = d * self._sx + scored_tokens
        self._sy = d * self._sy + seconds
        self._sxx = d * self._sxx + scored_tokens * scored_tokens
        self._sxy = d * self._sxy + scored_tokens * seconds

    def observe_drafts(self, rows: int, drafted: int, accepted: int, propose_s: float) -> None:
        if drafted <= 0:
            return
        share = accepted / drafted
        self.alpha = 0.8 * self.alpha + 0.2 * share
        self._drafted_per_row = 0.8 * self._drafted_per_row + 0.2 * drafted / max(1, rows)
        self._propose_s = 0.8 * self._propose_s + 0.2 * propose_s

    def cost_line(self) -> tuple[float, float] | None:
        """(c0, c1), or None while the steps seen do not vary enough in tokens to fit it."""
        if self._n < 4:
            return None
        mx, my = self._sx / self._n, self._sy / self._n
        var = self._sxx / self._n - mx * mx
        if var <= max(1.0, 0.01 * mx * mx):
            return None
        c1 = max(0.0, (self._sxy / self._n - mx * my) / var)
        return max(0.0, my - c1 * mx), c1

    def pays(self, rows: int) -> bool | None:
        """Whether drafting this step is expected to raise tokens per second (None: unknown)."""
        line = self.cost_line()
        if line is None:
            return None
        c0, c1 = line
        plain = c0 + c1 * rows
        if plain <= 0:
            return None
        drafted = self._drafted_per_row * rows
        return (rows + self.alpha * drafted) * plain > rows * (plain + c1 * drafted + self._propose_s)

    def decide(self, rows: int) -> bool:
        """Draft this step?"""
        self.steps += 1
        pays = self.pays(rows) if self.steps > self.warmup else None
        if pays is None:  # not measured yet: alternate, so the cost line sees both widths
            self.drafting = self.steps % 2 == 1
            return self.drafting
        self.drafting = pays
        if not self.drafting:
            self._since_draft += 1
            if self._since_draft >= self.probe_every:
                self._since_draft = 0
                return True  # a probe: keeps alpha and the cost line measured
            return False
        self._since_draft = 0
        return True
