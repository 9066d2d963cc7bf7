"""What a draft source is, and the registry of them.

A source looks at running sequences and returns, per sequence, candidate continuations with
their weights: matched occurrences in an index (history, siblings, n-grams), or a token tree
a model drafted with its own probabilities. The controller (:mod:`rhymerl.drafting.controller`)
owns everything else: the batch gate, draft lengths, and which source a request drafts from.
A new source is one class registered here under a name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from rhymerl.drafting.suffix_index import Matches, SuffixIndex, match_batch
from rhymerl.engine.draft import DraftTree

if TYPE_CHECKING:
    from rhymerl.drafting.config import SpecConfig
    from rhymerl.drafting.history import HistoryStore
    from rhymerl.engine.sequence import Sequence
    from rhymerl.model import CausalLM


@dataclass
class Candidate:
    """One source's answer for one sequence.

    Index sources fill ``occurrences`` (where the longest suffix of the context they matched,
    ``match`` tokens long, occurs; ``Matches.of_tokens`` wraps continuations a source picked
    itself; the controller ranks by the matches' own ``match``, which ``match`` mirrors);
    model sources fill ``tree`` and ``probs`` (each node's probability under the drafter, its
    parents' included)."""

    source: str
    match: int = 0
    occurrences: Matches | None = None
    tree: DraftTree | None = None
    probs: list[float] = field(default_factory=list)


@dataclass
class SourceContext:
    """What a source may read when it is built: the config, the history (read only: the
    training loop or the standalone ``LLM`` owns it), and the target model (model sources
    share its embeddings, device and dtype)."""

    cfg: "SpecConfig"
    store: "HistoryStore | None" = None
    target: "CausalLM | None" = None
    target_path: str | None = None  # the target's folder, when it was loaded from one (tokenizer checks)


class DraftSource:
    """Base class: a source answers :meth:`propose`; the hooks default to nothing."""

    name = "source"
    fallback = False  # asked only for rows whose best match so far is shorter than pattern_max
    wants_hidden = False  # needs the target's last hidden state per sequence (Sequence.hidden)
    runs_a_model = False  # drafting costs forwards of a model (the gate may leave it out alone)
    reads_history = False  # drafts from the history store (a run records one for it; vLLM's proposer too)
    merge_ties = False  # an equally long match of two merging sources pools their occurrences
    max_nodes = 0  # the most draft nodes one of its trees may have (0: bounded by the caps it is given)
    store: Any = None  # the history store it drafts from (None: none); new history may change whether it pays
    build_s = 0.0  # seconds of one-off index building since the gate last read it (kept out of step timings)

    def propose(self, seqs: list["Sequence"], caps: list[int], rows: list[int]) -> dict[int, Candidate]:
        """Candidates for ``seqs[i]``, ``i`` in ``rows`` (rows with ``caps[i] > 0``)."""
        out = {}
        for i in rows:
            c = self.candidate(seqs[i], caps[i])
            if c is not None:
                out[i] = c
        return out

    def candidate(self, seq: "Sequence", cap: int) -> Candidate | None:
        raise NotImplementedError

    def available(self, seqs: list["Sequence"]) -> bool:
        """Whether this source may have drafts for ``seqs`` at all, answered cheaply (no index
        built). The gate remembers across rollouts whether drafting paid, keyed on which
        sources are available: a prompt's first epoch (no history of its own) is not its third."""
        return True

    def on_admit(self, seqs: list["Sequence"]) -> None:
        """Sequences entered the running batch (new, or moved here from another worker)."""

    def load_state(self, named: dict[str, Any]) -> None:
        """Weights pushed with the policy's (a source that learns during RL reads its own names)."""

    def begin(self, step: int) -> None:
        """A new rollout step starts (the history may have changed)."""

    def on_finish(self, seq: "Sequence") -> None:
        """A sequence finished here."""

    def on_abort(self, seq: "Sequence") -> None:
        """A sequence left this engine unfinished (moved to another worker)."""
        self.on_finish(seq)


class IndexSource(DraftSource):
    """A source that drafts from a suffix index per row: a subclass says which index a row
    reads (:meth:`index_for`); the whole batch is matched in one call of the compiled core."""

    merge_ties = True

    def __init__(self, ctx: SourceContext) -> None:
        self.cfg = ctx.cfg

    def index_for(self, seq: "Sequence") -> SuffixIndex | None:
        raise NotImplementedError

    def sync(self) -> None:
        """Before each drafting step: bring the indices up to what the running sequences have
        emitted (for indices that follow them)."""

    def indices(self, seqs: list["Sequence"]) -> list[SuffixIndex | None]:
        """The index each sequence reads: what the controller matches in, for the batch at once."""
        index_for = self.index_for
        return [index_for(s) for s in seqs]

    def propose(self, seqs: list["Sequence"], caps: list[int], rows: list[int]) -> dict[int, Candidate]:
        picked = [seqs[i] for i in rows]
        found = match_batch([self.index_for(s) for s in picked], [s.output_ids for s in picked],
                            [s.prompt_ids for s in picked], self.cfg.pattern_max, self.cfg.pattern_min)
        name = self.name
        return {i: Candidate(name, m.match, m) for i, m in zip(rows, found) if m is not None}


SOURCES: dict[str, Callable[[SourceContext], DraftSource]] = {}


def register_source(name: str) -> Callable[[type], type]:
    """Class decorator: ``@register_source("ngram")`` makes the class buildable by name."""
    def wrap(cls: type) -> type:
        cls.name = name
        SOURCES[name] = cls
        return cls
    return wrap


def get_source(name: str) -> Callable[[SourceContext], DraftSource]:
    if name not in SOURCES:
        raise ValueError(f"speculative source {name!r} is not one of {sorted(SOURCES)}")
    return SOURCES[name]
