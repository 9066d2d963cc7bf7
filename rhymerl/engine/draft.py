"""The interface between the engine and a drafter: token trees to verify."""
from __future__ import annotations

from typing import Protocol, Sequence as Seq

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


class Proposer(Protocol):
    """What the engine asks of a drafter each decode step.

    Optional hooks, called when present: ``wants_cost_model`` + ``attach_cost_model(cost)``
    (the engine then measures its forward cost once at start-up), ``begin(step)`` (a new
    rollout step starts), and ``observe_time(B, width, seconds)`` (a decode step's measured
    time, drafting included).
    """

    max_nodes: int  # the most draft nodes any tree may have (sizes the KV headroom)

    def propose(self, seqs: list[Sequence]) -> list[DraftTree | None]:
        """One tree (or None) per running sequence, in slot order."""
        ...

    def observe(self, seqs: list[Sequence], drafted: list[int], accepted: list[int]) -> None:
        """What verification accepted, to adapt draft lengths."""
        ...

    def on_finish(self, seq: Sequence) -> None:
        """A sequence finished (its response may enter the history)."""
        ...
