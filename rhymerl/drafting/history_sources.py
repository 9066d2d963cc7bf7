"""Draft sources over stored history: a prompt's own previous responses, and every prompt's."""
from __future__ import annotations

import time

from rhymerl.drafting.source import IndexSource, SourceContext, register_source
from rhymerl.drafting.suffix_index import SuffixIndex
from rhymerl.engine.sequence import Sequence


def context(seq: Sequence, n: int) -> list[int]:
    """The last ``n`` tokens a draft continues (reaching into the prompt early in a response)."""
    out = seq.output_ids
    return out[-n:] if len(out) >= n else (seq.prompt_ids + out)[-n:]


@register_source("prompt_history")
class PromptHistorySource(IndexSource):
    """The prompt's responses of previous rollouts, each prefixed with the prompt's last
    tokens so that a response's first tokens can be drafted too. One index per prompt,
    rebuilt when the prompt's history changes."""

    reads_history = True

    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        self.store = ctx.store
        self._indices: dict[str, tuple[int, SuffixIndex]] = {}
        self.build_s = 0.0  # index building this step (a one-off, kept out of the gate's step timings)

    def begin(self, step: int) -> None:
        self._prune()

    def _prune(self) -> None:
        """Drop the indices of prompts the store no longer holds (evicted by its caps)."""
        if self.store is None:
            return
        for key in [k for k in self._indices if k not in self.store.prompts]:
            del self._indices[key]

    def stored(self, prompt_tail: list[int], response: list[int]) -> list[int]:
        return prompt_tail + response

    def index(self, key: str) -> SuffixIndex | None:
        h = self.store.prompts.get(key) if self.store is not None else None
        if h is None or not h.rollouts:
            return None
        cached = self._indices.get(key)
        if cached is not None and cached[0] == h.revision:
            return cached[1]
        t0 = time.perf_counter()
        idx = SuffixIndex()
        for r in h.rollouts:
            for resp, rew in zip(r.responses, r.rewards):
                idx.add(self.stored(h.prompt_tail, resp), 1.0 + self.cfg.reward_weight * (rew or 0.0), True)
        self._indices[key] = (h.revision, idx)
        if len(self._indices) > 2 * len(self.store.prompts) + 64:  # an engine never told of new steps
            self._prune()
        self.build_s += time.perf_counter() - t0
        return idx

    def index_for(self, seq: Sequence) -> SuffixIndex | None:
        return None if seq.prompt_key is None else self.index(seq.prompt_key)

    def available(self, seqs: list[Sequence]) -> bool:
        store = self.store
        return store is not None and any(s.prompt_key is not None and s.prompt_key in store for s in seqs)

    def indices(self, seqs: list[Sequence]) -> list[SuffixIndex | None]:
        found: dict[str | None, SuffixIndex | None] = {None: None}  # a prompt's samples share one
        out = []
        last, index = None, None
        for s in seqs:
            key = s.prompt_key
            if key != last:  # a prompt's samples mostly sit in neighbouring rows
                last = key
                if key not in found:
                    found[key] = self.index(key)
                index = found[key]
            out.append(index)
        return out


@register_source("global_history")
class GlobalHistorySource(IndexSource):
    """One index over every stored response to every prompt (no prompt prefix): responses to
    other prompts share the task's phrasing. A fallback: asked only where the prompt's own
    sources matched less than ``pattern_max`` tokens, and it wins only with a longer match
    (a tie keeps the prompt's own, more specific, continuations)."""

    fallback = True
    merge_ties = False
    reads_history = True

    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        self.store = ctx.store
        self._idx: SuffixIndex | None = None
        self._steps: dict[str, int] = {}  # prompt key -> newest rollout step in the index
        self._version = -1
        self._tokens = 0
        self._cursor = -1  # the store's log read up to here (HistoryStore.added_since)
        self.build_s = 0.0

    def index(self) -> SuffixIndex | None:
        """Appended to as prompts get new rollouts; rebuilt only when evicted history makes up
        most of it."""
        st = self.store
        if st is None:
            return None
        if self._version == st.version:
            return self._idx if self._idx is not None and len(self._idx) else None
        t0 = time.perf_counter()
        if self._idx is None or self._tokens > 2 * st.total_tokens + 4096:
            self._idx, self._tokens, self._steps, self._cursor = SuffixIndex(), 0, {}, -1
        new = st.added_since(self._cursor)
        if new is None:  # every prompt's rollouts (a new index, or a store whose log moved on)
            new = [(key, r.step) for key, h in st.prompts.items() for r in h.rollouts]
        for key, step in new:
            h = st.prompts.get(key)
            if h is None or step <= self._steps.get(key, -1):
                continue
            for r in h.rollouts:
                if r.step == step:
                    for resp in r.responses:
                        self._idx.add(resp, 1.0, True)
                        self._tokens += len(resp)
            self._steps[key] = step
        self._cursor = st.log_end()
        self._version = st.version
        self.build_s += time.perf_counter() - t0
        return self._idx if len(self._idx) else None

    def index_for(self, seq: Sequence) -> SuffixIndex | None:
        return self.index()

    def available(self, seqs: list[Sequence]) -> bool:
        return self.store is not None and self.store.total_tokens > 0

    def indices(self, seqs: list[Sequence]) -> list[SuffixIndex | None]:
        return [self.index()] * len(seqs)
