"""How far each row drafts on a vLLM step, and whether the step drafts at all, from this engine's
measured costs and acceptance (the native gate's idea, fitted to what a ``custom_class`` proposer
sees of vLLM's step).

A step with ``B`` rows verifying ``D`` drafted tokens costs ``c0 + cr * B + cd * D`` seconds, plus
``cs`` whenever ``D > 0`` (what the speculative path adds to a step: the rejection sampler, the
draft bookkeeping), fitted online by decayed least squares from the time between consecutive
``propose`` calls. Plain decoding makes a token for ``(c0 + cr * B) / B`` seconds; a drafted token
costs ``cd`` and yields the probability ``q`` that verification reaches and accepts it. It pays
when

    q > theta(B) = cd * B / (c0 + cr * B)

so on a compute-bound step (a CPU, a large GPU batch) only near-certain tokens are drafted, and in
a drained tail or a memory-bound GPU decode (``c0`` large) almost any are. Both this rule and the
step's below ask a draft to pay ``margin`` times its cost (1.1): a token that
merely breaks even by a fit of noisy step times is as likely to lose, and never slower is the
promise. ``q`` at draft position ``j`` is the product, over positions ``1..j``, of the
acceptance measured for drafted tokens of the same source (siblings, the prompt's history, every
prompt's) and the same confidence: the token's share of the continuations the index saw after
its context, weighed by how many it saw (:func:`token_confidence`), in tenths. A token every
earlier response continued with and one half of them did are accepted at different rates, and so
are one that sixteen responses agree on and one that a single response shows; the position adds
little once those are known (docs/design.md, "Drafting only as far as it pays, inside vLLM").
The step then drafts only if the tokens its kept drafts are expected to add, priced at plain
decoding's time per token, outweigh ``cs`` plus their verification: otherwise it runs as plain
decoding would.

Until the costs are fitted, steps cycle through drafting nothing, whole lengths and half lengths
(so rows, drafted tokens and the drafting step's fixed cost vary apart and can be told apart);
afterwards one step in ``probe_every`` drafts nothing and one drafts whole lengths on one row in
``probe_share`` (a different share each time), so the plain step's cost and acceptance deep in
drafts stay measured without paying for a whole batch's long drafts where verification is
compute-bound.
"""
from __future__ import annotations

import numpy as np


BUCKETS = 10  # a drafted token's confidence (its share of the index's continuations), in tenths
REFIT_EVERY = 4  # steps between refits of the step-cost fit the decisions read


def token_confidence(path_probs: np.ndarray, support: np.ndarray | None = None) -> np.ndarray:
    """Each drafted token's share of the continuations after its context, from the index's path
    probabilities (the product of those shares up to each token; 0 past a row's draft).

    With ``support`` (the weight of the continuations seen at each token's context), the share
    ``s`` of ``n`` is taken as ``(s * n + 1) / (n + 2)``: the expected share of a continuation
    seen ``s * n`` times in ``n`` (a uniform prior), so agreement of one response counts for less
    than agreement of sixteen."""
    p = np.asarray(path_probs, dtype=np.float64)
    prev = np.concatenate([np.ones((p.shape[0], 1)), p[:, :-1]], axis=1)
    share = np.divide(p, prev, out=np.zeros_like(p), where=prev > 0)
    if support is None:
        return share
    n = np.asarray(support, dtype=np.float64)
    return np.where(n > 0, (share * n + 1.0) / (n + 2.0), 0.0)


class DraftCutoff:
    def __init__(self, k: int, *, decay: float = 0.98, probe_every: int = 16, probe_share: int = 4,
                 prior_accept: float = 0.8, prior_weight: float = 4.0, margin: float = 1.1) -> None:
        self.k = k
        self.margin = margin
        self.decay = decay
        self.probe_every = probe_every
        self.probe_share = probe_share  # one row in this many drafts whole lengths on a probe step
        self.steps = 0
        self._fit: tuple[float, float, float, float] | None = None  # cost() as of step _fit_step
        self._fit_step = 0
        # decayed sums for the cost fit: X^T X over [1, B, D, D > 0] and X^T y
        self._xx = np.zeros((4, 4))
        self._xy = np.zeros(4)
        self._n = 0.0
        # per source (a row of each table), per confidence bucket: decayed counts of drafted tokens
        # verification reached and accepted
        self._prior = (prior_accept * prior_weight, prior_weight)
        self._source_row: dict[str | None, int] = {}
        self._reached = np.zeros((0, BUCKETS))
        self._accepted = np.zeros((0, BUCKETS))

    # --- what the proposer measures ------------------------------------------------------------
    def observe_step(self, rows: int, drafted: int, seconds: float) -> None:
        """One decode step (no prefill in it): its rows, the drafted tokens it verified, its time."""
        x = np.array([1.0, float(rows), float(drafted), float(drafted > 0)])
        d = self.decay
        self._xx = d * self._xx + np.outer(x, x)
        self._xy = d * self._xy + x * seconds
        self._n = d * self._n + 1.0

    def observe_drafts(self, sources: list[str | None], drafted: list[int], accepted: list[int],
                       confidence: np.ndarray) -> None:
        """Per row: its draft's source, tokens drafted, tokens accepted (verification reached
        positions ``1..accepted+1``, accepted ``1..accepted``) and its offered tokens'
        confidences (:func:`token_confidence`, a row per row)."""
        self._reached *= self.decay
        self._accepted *= self.decay
        n = np.asarray(drafted, dtype=np.int64)
        if not n.any():
            return
        a = np.minimum(np.asarray(accepted, dtype=np.int64), n)
        bucket = _buckets(confidence, int(n.max()))
        pos = np.arange(bucket.shape[1])
        # a cell per (row, position): its table row and bucket, flattened into one index
        cell = self._rows(sources)[:, None] * BUCKETS + bucket
        np.add.at(self._reached.reshape(-1), cell[pos[None, :] < np.minimum(n, a + 1)[:, None]], 1.0)
        np.add.at(self._accepted.reshape(-1), cell[pos[None, :] < a[:, None]], 1.0)

    def _rows(self, sources: list[str | None]) -> np.ndarray:
        """Each source's row in the tables (a new source gets one)."""
        index = self._source_row
        for src in set(sources) - index.keys():
            index[src] = len(index)
            self._reached = np.vstack([self._reached, np.zeros(BUCKETS)])
            self._accepted = np.vstack([self._accepted, np.zeros(BUCKETS)])
        return np.fromiter((index[x] for x in sources), np.int64, len(sources))

    # --- what it decides -------------------------------------------------------------------------
    def cost(self) -> tuple[float, float, float, float] | None:
        """(c0, cr, cd, cs) in seconds, or None while the steps seen cannot separate them."""
        if self._n < 8:
            return None
        xx = self._xx / self._n
        m = xx[0, 1:]  # means of rows, drafted tokens, drafting steps
        cov = xx[1:, 1:] - np.outer(m, m)
        var = np.diag(cov)
        if var.min() <= 1e-9 * max(1.0, float(m.max()) ** 2):
            return None  # one of them never varied
        corr = cov / np.sqrt(np.outer(var, var))
        if np.linalg.eigvalsh(corr).min() < 0.02:
            return None  # they moved together: their costs cannot be told apart
        c0, cr, cd, cs = np.linalg.solve(xx, self._xy / self._n)
        return float(c0), float(max(cr, 0.0)), float(max(cd, 0.0)), float(max(cs, 0.0))

    def _current_fit(self) -> tuple[float, float, float, float] | None:
        """:meth:`cost`, refitted every ``REFIT_EVERY`` steps once there is a fit: a decayed fit
        over about 50 steps moves little in a few, and the refit is the cutoff's costliest call."""
        if self._fit is None or self.steps - self._fit_step >= REFIT_EVERY:
            self._fit, self._fit_step = self.cost(), self.steps
        return self._fit

    def threshold(self, rows: int) -> float:
        """The acceptance probability a drafted token needs to pay on a step of ``rows`` rows
        (0: draft everything, while the cost is not yet measured)."""
        return _theta(self.cost(), rows)

    def acceptance(self, src: str | None) -> np.ndarray:
        """Per confidence bucket: the chance verification accepts a ``src`` token it reaches
        (measured, with a prior)."""
        return self._table()[self._rows([src])[0]]

    def _table(self) -> np.ndarray:
        pa, pw = self._prior
        return (self._accepted + pa) / (self._reached + pw)

    def reach(self, sources: list[str | None], confidence: np.ndarray, width: int) -> np.ndarray:
        """``q`` per row and draft position (``width`` of them): the chance verification accepts
        every token of the row's draft up to it."""
        rows = self._rows(sources)
        return np.cumprod(self._table()[rows[:, None], _buckets(confidence, width)], axis=1)

    def lengths(self, rows: int, sources: list[str | None], available: list[int], confidence: np.ndarray) -> list[int]:
        """How many of its ``available`` draft tokens each row (drafting from ``sources[i]``, its
        tokens' ``confidence`` a row per row) keeps on this step; all zero when the step should
        run as plain decoding."""
        self.steps += 1
        k = self.k
        fit = self._current_fit()
        phase = self.steps % (4 if fit is None else self.probe_every)
        if phase == 0:  # a plain step: the cost without drafting stays measured
            return [0] * len(available)
        if fit is None:  # not measured yet: whole and half lengths, so drafted tokens vary apart from rows
            return [min(a, max(1, k // 2)) for a in available] if phase == 2 else list(available)
        keep = self._keep(fit, rows, sources, available, confidence)
        if phase == 1:  # whole lengths on a rotating share of the rows: acceptance deep in drafts stays measured
            lap = self.steps // self.probe_every
            keep = [a if (i + lap) % self.probe_share == 0 else n for i, (a, n) in enumerate(zip(available, keep))]
        return keep

    def _keep(self, fit: tuple[float, float, float, float], rows: int, sources: list[str | None],
              available: list[int], confidence: np.ndarray) -> list[int]:
        c0, cr, cd, cs = fit
        width = max(available, default=0)
        if width == 0:
            return [0] * len(available)
        theta = self.margin * _theta(fit, rows)
        q = self.reach(sources, confidence, width)
        offered = np.arange(width)[None, :] < np.asarray(available)[:, None]
        pays = (q >= theta) & offered  # a prefix of each row: q only falls along a draft
        keep = pays.sum(axis=1)
        gain = float(q[pays].sum())  # expected accepted tokens
        plain_per_token = (c0 + cr * rows) / max(1, rows)
        drafted = int(keep.sum())
        if drafted == 0 or gain * plain_per_token <= self.margin * (cs + cd * drafted):
            return [0] * len(available)
        return keep.tolist()


def _theta(fit: tuple[float, float, float, float] | None, rows: int) -> float:
    """``cd * B / (c0 + cr * B)`` for a fit (0 without one)."""
    if fit is None or rows <= 0:
        return 0.0
    c0, cr, cd, _ = fit
    plain = c0 + cr * rows
    return 1.0 if plain <= 0 else cd * rows / plain


def _buckets(confidence: np.ndarray, width: int) -> np.ndarray:
    """Each token's confidence bucket (``BUCKETS`` of them), ``width`` positions per row (0 past
    what ``confidence`` holds)."""
    c = np.asarray(confidence, dtype=np.float64)
    c = c[:, :width] if c.shape[1] >= width else np.pad(c, ((0, 0), (0, width - c.shape[1])))
    return np.minimum((c * BUCKETS).astype(np.int64), BUCKETS - 1)
