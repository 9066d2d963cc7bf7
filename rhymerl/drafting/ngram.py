"""Peer drafter: vLLM-style n-gram prompt lookup within the request's own tokens.

The longest suffix n-gram (``prompt_lookup_max`` down to ``prompt_lookup_min``) found
earlier in the request proposes the tokens that followed its most recent occurrence. No
memory across requests. It runs under the same length control and gate as HistoSpec, so
a comparison isolates where the drafts come from.
"""
from __future__ import annotations

from rhymerl.drafting.drafter import DrafterConfig, HistoryDrafter
from rhymerl.drafting.suffix_index import SuffixIndex
from rhymerl.engine.draft import DraftTree
from rhymerl.engine.sequence import Sequence


class NgramDrafter(HistoryDrafter):
    def __init__(self, cfg: DrafterConfig | None = None, prompt_lookup_min: int = 3,
                 prompt_lookup_max: int = 7) -> None:
        cfg = cfg or DrafterConfig()
        cfg.use_history, cfg.siblings, cfg.record = False, False, False
        super().__init__(cfg)
        self.lo, self.hi = prompt_lookup_min, prompt_lookup_max
        self._own: dict[tuple[int, int], SuffixIndex] = {}

    def _draft(self, s: Sequence, cap: int) -> DraftTree | None:
        key = (s.request_id, s.sample_index)
        idx = self._own.get(key)
        if idx is None:
            idx = self._own[key] = SuffixIndex()
            idx.add(list(s.prompt_ids) + list(s.output_ids), final=False)
        else:
            toks = idx.seqs[0]
            toks.extend(s.all_ids()[len(toks):])
            idx.extend(0)
        occ, _ = idx.match(s.all_ids()[-self.hi:], self.hi, self.lo)
        if not occ:
            return None
        o = max(occ, key=lambda x: x.pos)  # most recent occurrence
        toks = o.tokens[o.pos: o.pos + cap]
        return DraftTree.path(toks) if toks else None

    def on_finish(self, seq: Sequence) -> None:
        self._own.pop((seq.request_id, seq.sample_index), None)
