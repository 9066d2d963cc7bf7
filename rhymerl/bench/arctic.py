"""Peer drafter: arctic-inference's ``SuffixDecodingCache`` (optional extra ``[bench]``).

Fed the same history as HistoSpec: either one global cache over all prompts' responses
(vLLM's ``suffix`` method) or one cache per prompt. Response ids must be unique per
prompt, epoch and sample: ``start_request`` on a cached id evicts it.
"""
from __future__ import annotations

from rhymerl.drafting import DrafterConfig, HistoryDrafter, HistoryStore
from rhymerl.engine.draft import DraftTree
from rhymerl.engine.sequence import Sequence


class ArcticSuffixDrafter(HistoryDrafter):
    def __init__(self, store: HistoryStore, *, per_prompt: bool, max_draft: int = 16, gate: bool = True) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401  (ImportError = skip)

        super().__init__(DrafterConfig(max_draft=max_draft, record=False, siblings=False, use_history=False,
                                       gate=gate))
        self._cls = SuffixDecodingCache
        self.per_prompt = per_prompt
        self.caches: dict[str, object] = {}
        self._sent: dict[int, int] = {}  # id(sequence) -> output tokens already sent to the cache
        uid = 0
        for key, h in store.prompts.items():
            cache = self._cache(key)
            for r in h.rollouts:
                for resp in r.responses:
                    uid += 1
                    rid = f"hist-{key}-{r.step}-{uid}"
                    cache.start_request(rid, h.prompt_tail)
                    cache.add_active_response(rid, resp)
                    cache.stop_request(rid)

    def _cache(self, key: str):
        k = key if self.per_prompt else "_global"
        if k not in self.caches:
            self.caches[k] = self._cls(max_tree_depth=64, max_cached_requests=1 << 20)
        return self.caches[k]

    def _draft(self, s: Sequence, cap: int) -> DraftTree | None:
        cache = self._cache(s.prompt_key or "")
        rid = f"live-{s.request_id}-{s.sample_index}"
        sent = self._sent.get(id(s))
        if sent is None:
            cache.start_request(rid, list(s.prompt_ids))
            cache.add_active_response(rid, list(s.output_ids))
        elif len(s.output_ids) > sent:
            cache.add_active_response(rid, s.output_ids[sent:])
        self._sent[id(s)] = len(s.output_ids)
        ctx = (s.prompt_ids + s.output_ids)[-64:]
        d = cache.speculate(rid, ctx, max_spec_tokens=int(cap), max_spec_factor=1.0, min_token_prob=self.cfg.min_prob)
        toks = list(d.token_ids)[:cap]
        return DraftTree.path(toks) if toks else None

    def on_finish(self, seq: Sequence) -> None:
        if self._sent.pop(id(seq), None) is not None:
            self._cache(seq.prompt_key or "").stop_request(f"live-{seq.request_id}-{seq.sample_index}")
