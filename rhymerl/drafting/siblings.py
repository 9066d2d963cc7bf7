"""Draft source over live siblings: the prompt and the tokens that a request's own samples
have produced so far in this step (siblings rhyme too; this drafts in the first epoch)."""
from __future__ import annotations

from dataclasses import dataclass, field

from rhymerl.drafting.history_sources import context
from rhymerl.drafting.source import Candidate, DraftSource, SourceContext, register_source
from rhymerl.drafting.suffix_index import SuffixIndex
from rhymerl.engine.sequence import Sequence


@dataclass
class _Live:
    index: SuffixIndex
    members: dict[int, tuple[int, Sequence]] = field(default_factory=dict)  # sample -> (id in index, seq)
    finished: int = 0
    synced: int = -1  # the step its members' tokens were last indexed at


@register_source("siblings")
class SiblingSource(DraftSource):
    merge_ties = True

    def __init__(self, ctx: SourceContext) -> None:
        self.cfg = ctx.cfg
        self._live: dict[object, _Live] = {}
        self._tick = 0

    def key(self, s: Sequence) -> object:
        """Sequences that share a live index: all samples of a request."""
        return s.request_id

    def size(self, s: Sequence) -> int:
        return s.group_size or s.params.n

    def prepare(self, seqs: list[Sequence]) -> None:
        """Give new sequences a place in their live index (their tokens are indexed lazily,
        when a draft is made, so steps the gate skips cost no indexing)."""
        self._tick += 1
        for s in seqs:
            k = self.key(s)
            live = self._live.get(k)
            if live is None:
                live = self._live[k] = _Live(SuffixIndex())
                live.index.add(list(s.prompt_ids), final=False)
            if s.sample_index not in live.members:
                tail = s.prompt_ids[-self.cfg.pattern_max:]
                live.members[s.sample_index] = (live.index.add(list(tail), final=False), s)

    def _sync(self, live: _Live) -> None:
        """Index what the members emitted since the last sync (once per step: every member of
        a group drafts from the same index)."""
        if live.synced == self._tick:
            return
        live.synced = self._tick
        for sid, s in live.members.values():
            toks = live.index.seqs[sid]
            have = len(toks) - min(len(s.prompt_ids), self.cfg.pattern_max)
            if have < len(s.output_ids):
                toks.extend(s.output_ids[have:])
                live.index.extend(sid)

    def candidate(self, seq: Sequence, cap: int) -> Candidate | None:
        live = self._live.get(self.key(seq))
        if live is None:
            return None
        self._sync(live)
        occ, m = live.index.match(context(seq, self.cfg.pattern_max), self.cfg.pattern_max, self.cfg.pattern_min)
        return Candidate(self.name, m, occ, merge_ties=self.merge_ties) if occ else None

    def on_finish(self, seq: Sequence) -> None:
        """A member is done here; the live index goes once all of them are."""
        k = self.key(seq)
        live = self._live.get(k)
        if live is not None:
            live.finished += 1
            if live.finished >= self.size(seq):
                del self._live[k]
