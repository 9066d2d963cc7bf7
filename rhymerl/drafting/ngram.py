"""Peer source: vLLM-style n-gram prompt lookup within the request's own tokens.

The longest suffix n-gram (``prompt_lookup_max`` down to ``prompt_lookup_min``) found
earlier in the request proposes the tokens that followed its most recent occurrence. No
memory across requests.
"""
from __future__ import annotations

from rhymerl.drafting.source import Candidate, DraftSource, SourceContext, register_source
from rhymerl.drafting.suffix_index import SuffixIndex
from rhymerl.engine.sequence import Sequence


@register_source("ngram")
class NgramSource(DraftSource):
    def __init__(self, ctx: SourceContext) -> None:
        self.lo, self.hi = ctx.cfg.prompt_lookup_min, ctx.cfg.prompt_lookup_max
        self._own: dict[tuple[int, int], SuffixIndex] = {}

    def candidate(self, seq: Sequence, cap: int) -> Candidate | None:
        key = (seq.request_id, seq.sample_index)
        idx = self._own.get(key)
        if idx is None:
            idx = self._own[key] = SuffixIndex()
            idx.add(list(seq.prompt_ids) + list(seq.output_ids), final=False)
        else:
            toks = idx.seqs[0]
            toks.extend(seq.all_ids()[len(toks):])
            idx.extend(0)
        occ, m = idx.match(seq.all_ids()[-self.hi:], self.hi, self.lo)
        if not occ:
            return None
        # the most recent occurrence alone: its continuation is the draft
        return Candidate(self.name, m, [max(occ, key=lambda o: o.pos)])

    def on_finish(self, seq: Sequence) -> None:
        self._own.pop((seq.request_id, seq.sample_index), None)
