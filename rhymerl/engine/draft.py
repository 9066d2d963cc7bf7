"""The interface between the engine and a drafter: token trees to verify."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence as Seq

from rhymerl.engine.sequence import Sequence


@dataclass(frozen=True)
class DraftTree:
    """Candidate continuations of one sequence, verified together in one forward pass.

    Node ``i`` carries ``tokens[i]``; ``parents[i]`` is the index of its parent node, or -1
    when it continues the sequence's last token directly. Parents come before children,
    and siblings carry distinct tokens. A path draft is the chain ``parents = [-1, 0, 1, ...]``.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...] = field(init=False, repr=False, compare=False)  # 1 for children of the root
    is_path: bool = field(init=False, repr=False, compare=False)  # a chain: node i's parent is i - 1

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("DraftTree: tokens and parents differ in length")
        seen: set[tuple[int, int]] = set()
        depths: list[int] = []
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            if not -1 <= p < i:
                raise ValueError(f"DraftTree: node {i} has parent {p}; parents must precede children")
            if (p, t) in seen:
                raise ValueError(f"DraftTree: node {i} repeats token {t} under parent {p}")
            seen.add((p, t))
            depths.append(1 if p < 0 else depths[p] + 1)
        object.__setattr__(self, "depths", tuple(depths))
        object.__setattr__(self, "is_path", all(d == i + 1 for i, d in enumerate(depths)))

    @property
    def depth(self) -> int:
        return len(self.tokens) if self.is_path else max(self.depths, default=0)

    @staticmethod
    def path(tokens: Seq[int]) -> "DraftTree":
        # A chain is valid by construction: skip the checks (this runs for every row, every step).
        t = tuple(tokens)
        shape = _CHAINS.get(len(t))
        if shape is None:
            shape = _CHAINS[len(t)] = (tuple(range(-1, len(t) - 1)), tuple(range(1, len(t) + 1)))
        d = object.__new__(DraftTree)
        setattr_ = object.__setattr__
        setattr_(d, "tokens", t)
        setattr_(d, "parents", shape[0])
        setattr_(d, "depths", shape[1])
        setattr_(d, "is_path", True)
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
