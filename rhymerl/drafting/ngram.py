"""Peer source: vLLM-style n-gram prompt lookup within the request's own tokens.

The longest suffix n-gram (``prompt_lookup_max`` down to ``prompt_lookup_min``) found
earlier in the request proposes the tokens that followed its most recent occurrence. No
memory across requests.
"""
from __future__ import annotations

from rhymerl.drafting.source import Candidate, DraftSource, SourceContext, register_source
from rhymerl.drafting.suffix_index import SuffixIndex, match_batch
from rhymerl.engine.sequence import Sequence


@register_source("ngram")
class NgramSource(DraftSource):
    def __init__(self, ctx: SourceContext) -> None:
        self.lo, self.hi = ctx.cfg.prompt_lookup_min, ctx.cfg.prompt_lookup_max
        self._own: dict[tuple[int, int], SuffixIndex] = {}

    def _index(self, seq: Sequence) -> SuffixIndex:
        """The request's own tokens, indexed as they grow (prompt first, then output)."""
        key = (seq.request_id, seq.sample_index)
        idx = self._own.get(key)
        if idx is None:
            idx = self._own[key] = SuffixIndex()
            idx.add(seq.prompt_ids, 1.0, False)
        have = idx.size(0) - len(seq.prompt_ids)
        if have < len(seq.output_ids):
            idx.append(0, seq.output_ids, have)
        return idx

    def propose(self, seqs: list[Sequence], caps: list[int], rows: list[int]) -> dict[int, Candidate]:
        picked = [seqs[i] for i in rows]
        found = match_batch([self._index(s) for s in picked], [s.output_ids for s in picked],
                            [s.prompt_ids for s in picked], self.hi, self.lo)
        # the most recent occurrence alone: its continuation is the draft
        return {i: Candidate(self.name, m.match, m.most_recent()) for i, m in zip(rows, found) if m is not None}

    def on_finish(self, seq: Sequence) -> None:
        self._own.pop((seq.request_id, seq.sample_index), None)
