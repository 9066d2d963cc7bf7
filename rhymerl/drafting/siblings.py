"""Draft source over live siblings: the prompt and the tokens that a request's own samples
have produced so far in this step (siblings rhyme too; this drafts in the first epoch)."""
from __future__ import annotations

from dataclasses import dataclass, field

from rhymerl.drafting.source import IndexSource, SourceContext, register_source
from rhymerl.drafting.suffix_index import SuffixIndex
from rhymerl.engine.sequence import Sequence


@dataclass
class _Live:
    index: SuffixIndex  # the prompt, then each member's prompt tail followed by its output
    members: set[int] = field(default_factory=set)  # sample indices
    finished: int = 0


_NO_KEY = object()


@register_source("siblings")
class SiblingSource(IndexSource):
    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        self._live: dict[object, _Live] = {}

    def key(self, s: Sequence) -> object:
        """Sequences that share a live index: all samples of a request."""
        return s.request_id

    def size(self, s: Sequence) -> int:
        return s.group_size or s.params.n

    def on_admit(self, seqs: list[Sequence]) -> None:
        """Give sequences entering the batch a place in their live index (their tokens are
        indexed lazily, when a draft is made, so steps the gate skips cost no indexing)."""
        live_of, pm = self._live, self.cfg.pattern_max
        for s in seqs:
            k = self.key(s)
            live = live_of.get(k)
            if live is None:
                live = live_of[k] = _Live(SuffixIndex())
                live.index.add(s.prompt_ids, 1.0, False)
            if s.sample_index not in live.members:
                tail = s.prompt_ids[-pm:]
                live.members.add(s.sample_index)
                # The engine grows output_ids in place: the index follows the list itself.
                live.index.follow(live.index.add(tail, 1.0, False), s.output_ids, len(tail))

    def index_for(self, seq: Sequence) -> SuffixIndex | None:
        live = self._live.get(self.key(seq))
        if live is None:
            return None
        live.index.sync()
        return live.index

    def sync(self) -> None:
        """Index what every live request's samples emitted since the last drafting step."""
        SuffixIndex.sync_all([live.index for live in self._live.values()])

    def indices(self, seqs: list[Sequence]) -> list[SuffixIndex | None]:
        live_of, key, out = self._live, self.key, []
        last_key: object = _NO_KEY
        index = None
        for s in seqs:
            k = key(s)
            if k != last_key:  # a request's samples mostly sit in neighbouring rows
                last_key, live = k, live_of.get(k)
                index = None if live is None else live.index
            out.append(index)
        return out

    def on_finish(self, seq: Sequence) -> None:
        """A member is done here; the live index goes once all of them are."""
        k = self.key(seq)
        live = self._live.get(k)
        if live is not None:
            live.finished += 1
            if live.finished >= self.size(seq):
                del self._live[k]
