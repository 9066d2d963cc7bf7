"""The interface between the engine and a drafter: token trees to verify, one per row
(:class:`DraftTree`) or the whole batch's at once (:class:`DraftBatch`)."""
from __future__ import annotations

from typing import Any, Sequence as Seq, Union

import torch

from rhymerl.engine.sequence import Sequence


class DraftTree:
    """Candidate continuations of one sequence, verified together in one forward pass.

    Node ``i`` carries ``tokens[i]``; ``parents[i]`` is the index of its parent node, or -1
    when it continues the sequence's last token directly. Parents come before children,
    and siblings carry distinct tokens. A path draft is the chain ``parents = [-1, 0, 1, ...]``.
    ``depths[i]`` is 1 for the root's children; ``is_path``: node i's parent is i - 1.

    A value: treat it as immutable. A plain class with slots, not a frozen dataclass: a
    drafter makes one per row every decode step, and a frozen dataclass costs 3x as much.
    """

    __slots__ = ("tokens", "parents", "depths", "is_path")

    def __init__(self, tokens: Seq[int], parents: Seq[int]) -> None:
        tokens, parents = tuple(tokens), tuple(parents)
        if len(tokens) != len(parents):
            raise ValueError("DraftTree: tokens and parents differ in length")
        seen: set[tuple[int, int]] = set()
        depths: list[int] = []
        for i, (t, p) in enumerate(zip(tokens, parents)):
            if not -1 <= p < i:
                raise ValueError(f"DraftTree: node {i} has parent {p}; parents must precede children")
            if (p, t) in seen:
                raise ValueError(f"DraftTree: node {i} repeats token {t} under parent {p}")
            seen.add((p, t))
            depths.append(1 if p < 0 else depths[p] + 1)
        self.tokens, self.parents = tokens, parents
        self.depths = tuple(depths)
        self.is_path = all(d == i + 1 for i, d in enumerate(depths))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DraftTree) and (self.tokens, self.parents) == (other.tokens, other.parents)

    def __hash__(self) -> int:
        return hash((self.tokens, self.parents))

    def __repr__(self) -> str:
        return f"DraftTree(tokens={self.tokens!r}, parents={self.parents!r})"

    @property
    def depth(self) -> int:
        return len(self.tokens) if self.is_path else max(self.depths, default=0)

    @staticmethod
    def path(tokens: Seq[int]) -> "DraftTree":
        # A chain is valid by construction: no checks (this runs for every row, every step).
        d = DraftTree.__new__(DraftTree)
        d.tokens = t = tuple(tokens)
        shape = _CHAINS.get(len(t))
        if shape is None:
            shape = _CHAINS[len(t)] = (tuple(range(-1, len(t) - 1)), tuple(range(1, len(t) + 1)))
        d.parents, d.depths = shape
        d.is_path = True
        return d

    @staticmethod
    def built(tokens: tuple[int, ...], parents: tuple[int, ...], depths: tuple[int, ...]) -> "DraftTree":
        """A tree whose maker guarantees the invariants (the compiled drafter): no checks."""
        d = DraftTree.__new__(DraftTree)
        d.tokens, d.parents, d.depths = tokens, parents, depths
        shape = _CHAINS.get(len(parents))
        d.is_path = parents == (shape[0] if shape is not None else tuple(range(-1, len(parents) - 1)))
        return d

    def __len__(self) -> int:
        return len(self.tokens)


_CHAINS: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # length -> a path's (parents, depths)


class DraftBatch:
    """Every row's draft tree, padded to one width ``W``: ``tokens``, ``parents`` (-1: the
    row's last token) and ``depths`` (1 for the root's children) are ``[B, W]`` int64 tensors,
    valid below ``lengths[b]`` (padding: token -1, parent -1, depth 0). A row's nodes are in
    :class:`DraftTree` order (parents first), so any prefix of a row is a tree. ``is_path``:
    every row is a chain. What one verification forward scores, built by a drafter for the
    whole batch at once (no per-row objects on the hot path)."""

    __slots__ = ("tokens", "parents", "depths", "lengths", "is_path")

    def __init__(self, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, lengths: list[int],
                 is_path: bool) -> None:
        self.tokens, self.parents, self.depths = tokens, parents, depths
        self.lengths, self.is_path = lengths, is_path

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    def __len__(self) -> int:
        return len(self.lengths)

    @staticmethod
    def from_trees(trees: Seq[DraftTree | None]) -> "DraftBatch | None":
        """One tree (or None) per row; None where no row has a draft."""
        lengths = [len(t) if t is not None else 0 for t in trees]
        W = max(lengths, default=0)
        if W == 0:
            return None
        tok, par, dep = [], [], []
        for t, n in zip(trees, lengths):
            pad = W - n
            if n:
                tok.append([*t.tokens, *([-1] * pad)])  # type: ignore[union-attr]
                par.append([*t.parents, *([-1] * pad)])  # type: ignore[union-attr]
                dep.append([*t.depths, *([0] * pad)])  # type: ignore[union-attr]
            else:
                tok.append([-1] * W)
                par.append([-1] * W)
                dep.append([0] * W)
        return DraftBatch(torch.tensor(tok), torch.tensor(par), torch.tensor(dep), lengths,
                          all(t is None or t.is_path for t in trees))

    def tree(self, b: int) -> DraftTree | None:
        """Row ``b``'s draft as a tree (None: no draft)."""
        n = self.lengths[b]
        if n == 0:
            return None
        toks = tuple(self.tokens[b, :n].tolist())
        if self.is_path:
            return DraftTree.path(toks)
        return DraftTree.built(toks, tuple(self.parents[b, :n].tolist()), tuple(self.depths[b, :n].tolist()))

    def __iter__(self):
        return (self.tree(b) for b in range(len(self)))

    def truncated(self, k: int) -> "DraftBatch":
        """At most ``k`` nodes a row (a prefix of each row's nodes)."""
        if k >= self.width:
            return self
        return DraftBatch(self.tokens[:, :k], self.parents[:, :k], self.depths[:, :k],
                          [n if n < k else k for n in self.lengths], self.is_path)

    def row_depths(self) -> list[int]:
        """Each row's deepest node (0 without a draft)."""
        if self.is_path:
            return list(self.lengths)
        return self.depths.max(dim=1).values.tolist() if self.width else [0] * len(self)


Drafts = Union[DraftBatch, Seq[Union[DraftTree, None]], None]


def as_batch(drafts: Drafts) -> DraftBatch | None:
    """What a proposer returned, as a batch (None: nothing to verify)."""
    if drafts is None or isinstance(drafts, DraftBatch):
        return drafts if drafts is None or any(drafts.lengths) else None
    return DraftBatch.from_trees(drafts)


class Proposer:
    """What the engine asks of a drafter: ``propose`` each decode step, ``observe`` what
    verification accepted. Every other hook is a no-op here; a drafter overrides what it uses,
    and the engine calls them all unconditionally."""

    max_nodes: int = 0  # the most draft nodes any tree may have (sizes the KV headroom)
    wants_hidden: bool = False  # the engine keeps the target's last hidden states for it
    wants_cost_model: bool = False  # the engine measures its forward cost once, then attach_cost_model()

    def propose(self, seqs: list[Sequence]) -> Drafts:
        """The drafts of the running sequences, in slot order: a :class:`DraftBatch`, one
        tree (or None) per sequence, or None for no drafts this step."""
        raise NotImplementedError

    def observe(self, seqs: list[Sequence], drafted: list[int], accepted: list[int]) -> None:
        """What verification accepted, per row (drafted and accepted tokens)."""

    def observe_time(self, B: int, width: int, seconds: float) -> None:
        """A decode step's measured time, drafting, forward and verification included."""

    def attach_cost_model(self, cost: Any) -> None:
        """The engine's measured forward cost (a :class:`rhymerl.engine.cost_model.CostModel`)."""

    def begin(self, step: int) -> None:
        """A new rollout step starts."""

    def on_admit(self, seqs: list[Sequence]) -> None:
        """Sequences entered the running batch, after their prefill."""

    def on_finish(self, seq: Sequence) -> None:
        """A sequence finished (its response may enter the history)."""

    def on_abort(self, seq: Sequence) -> None:
        """A sequence was stopped before it finished (moved to another worker)."""

    def load_source_state(self, named: dict[str, Any]) -> None:
        """Weights a draft source learns during RL (``draft_head.*``), pushed with the policy's."""
        raise KeyError(f"{sorted(named)[0]!r}: this proposer has no source that learns weights")

    def counters(self) -> dict[str, float]:
        """Running totals the proposer keeps, by name (for example ``accepted/<source>``)."""
        return {}

    def gate_state(self) -> dict | None:
        """What the proposer learnt about this machine, as plain data (None: nothing), for checkpoints."""
        return None

    def load_gate_state(self, state: dict) -> None:
        """Inverse of :meth:`gate_state`."""
