"""Peer draft sources for ``bench spec``: SuffixDecoding (arctic-inference; vLLM's ``suffix``
method), as arctic uses its ``SuffixDecodingCache`` when it is installed, and our
re-implementation of its sources on our index otherwise (``impl`` says which ran).

SuffixDecoding drafts from a tree over past responses (one global tree, or one per prompt),
stored without the prompt, plus a per-request tree over the request's own prompt and output;
no sibling samples. Both run under the same controller (gate, draft lengths) as HistoSpec.
"""
from __future__ import annotations

from rhymerl.drafting import HistoryStore, SourceContext, SpecConfig, SpecController
from rhymerl.drafting.history_sources import GlobalHistorySource, PromptHistorySource, context
from rhymerl.drafting.siblings import SiblingSource
from rhymerl.drafting.source import Candidate, DraftSource
from rhymerl.engine.sequence import Sequence


class _PromptTree(PromptHistorySource):
    name = "suffix_prompt"

    def stored(self, prompt_tail: list[int], response: list[int]) -> list[int]:
        return list(response)


class _GlobalTree(GlobalHistorySource):
    name = "suffix_global"
    fallback = False
    merge_ties = True


class _OwnTokens(SiblingSource):
    """The per-request tree: one live index per sample (no siblings)."""

    name = "suffix_request"

    def key(self, s: Sequence) -> object:
        return (s.request_id, s.sample_index)

    def size(self, s: Sequence) -> int:
        return 1


def suffix_decoding(store: HistoryStore, cfg: SpecConfig, *, per_prompt: bool) -> SpecController:
    """Our re-implementation of SuffixDecoding's sources under HistoSpec's controller."""
    ctx = SourceContext(cfg, store)
    tree = _PromptTree(ctx) if per_prompt else _GlobalTree(ctx)
    return SpecController(cfg, store, sources=[tree, _OwnTokens(ctx)])


class ArcticSource(DraftSource):
    """arctic-inference's ``SuffixDecodingCache``, fed the same history: finished responses
    as stopped requests (a global cache, or one per prompt), each live sample as an active
    request. Response ids are unique per prompt, epoch and sample (``start_request`` on a
    cached id evicts it)."""

    name = "arctic"

    def __init__(self, cfg: SpecConfig, store: HistoryStore, *, per_prompt: bool) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # ImportError: not installed

        self.cfg, self.per_prompt, self._cls = cfg, per_prompt, SuffixDecodingCache
        self.caches: dict[str, object] = {}
        self._sent: dict[tuple[int, int], int] = {}  # sample -> output tokens already sent to the cache
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

    def candidate(self, s: Sequence, cap: int) -> Candidate | None:
        from rhymerl.drafting.suffix_index import Matches

        cache = self._cache(s.prompt_key or "")
        rid = f"live-{s.request_id}-{s.sample_index}"
        key = (s.request_id, s.sample_index)
        sent = self._sent.get(key)
        if sent is None:
            cache.start_request(rid, list(s.prompt_ids))
            cache.add_active_response(rid, list(s.output_ids))
        elif len(s.output_ids) > sent:
            cache.add_active_response(rid, s.output_ids[sent:])
        self._sent[key] = len(s.output_ids)
        ctx = context(s, 64)
        d = cache.speculate(rid, ctx, max_spec_tokens=int(cap), max_spec_factor=1.0, min_token_prob=self.cfg.min_prob)
        toks = list(d.token_ids)[:cap]
        # arctic chose the path: one occurrence that continues with it
        return Candidate(self.name, len(ctx), Matches.of_tokens([toks], len(ctx))) if toks else None

    def on_finish(self, seq: Sequence) -> None:
        if self._sent.pop((seq.request_id, seq.sample_index), None) is not None:
            self._cache(seq.prompt_key or "").stop_request(f"live-{seq.request_id}-{seq.sample_index}")


def arctic(store: HistoryStore, cfg: SpecConfig, *, per_prompt: bool) -> SpecController:
    return SpecController(cfg, store, sources=[ArcticSource(cfg, store, per_prompt=per_prompt)])
