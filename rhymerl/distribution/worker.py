"""One rollout worker: an engine with its own copy of the weights, driven in short slices."""
from __future__ import annotations

import time
from typing import Any, Mapping

import torch

from rhymerl.distribution.work import ENGINE_COUNTERS, ItemResult, WorkerReport, WorkerSpec, WorkItem


class RolloutWorker:
    """Runs work items on its engine; the same class backs the in-process, process and Ray workers."""

    def __init__(self, spec: WorkerSpec) -> None:
        from rhymerl.llm import LLM

        if spec.threads > 0:  # 0: an in-process worker keeps the caller's threads
            torch.set_num_threads(spec.threads)
        self.llm = LLM(spec.model_path, max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len,
                       device=spec.device, dtype=spec.dtype, speculative=spec.speculative, seed=spec.seed,
                       invariant=spec.invariant)
        self.engine = self.llm.engine
        # The controller owns the history: this worker's copy holds what arrives with its work
        # (the engine is driven directly here, so nothing is recorded into it).
        self.store = self.llm.history
        self._rid_item: dict[int, int] = {}
        self._item_rid: dict[int, int] = {}
        self._step: int | None = None
        self._done: list[ItemResult] = []  # finished by an abort, reported with the next advance
        self._mark = self._counters()

    def _counters(self) -> dict[str, float]:
        st = self.engine.stats
        out = {k: getattr(st, k) for k in ENGINE_COUNTERS}
        if self.engine.proposer is not None:  # per draft source: which source earned the tokens
            out.update(self.engine.proposer.counters())
        return out

    def ping(self) -> int:
        import os

        return os.getpid()

    def update_weights(self, named: Mapping[str, torch.Tensor]) -> None:
        self.llm.update_weights(named)

    def update_weights_numpy(self, named: Mapping[str, Any]) -> None:
        """Weights as numpy arrays (from Ray's object store, read without a copy)."""
        self.llm.update_weights({n: torch.from_numpy(a) for n, a in named.items()})

    def gate_state(self) -> dict[str, Any] | None:
        """The drafter's gate state (speed only: tokens never depend on it), for checkpoints."""
        return self.engine.proposer.gate_state() if self.engine.proposer is not None else None

    def load_gate_state(self, state: dict[str, Any]) -> None:
        if self.engine.proposer is not None:
            self.engine.proposer.load_gate_state(state)

    def advance(self, items: list[WorkItem], step: int, seconds: float, until_finished: bool = False) -> WorkerReport:
        """Queue ``items``, then run engine steps for about ``seconds`` (at least one step), or
        with ``until_finished`` until an item finishes, if sooner."""
        finished, self._done = [r for r in self._done if r.outputs], []
        for it in items:
            if self.store is not None and it.prompt_key is not None:
                self.store.put(it.prompt_key, it.prompt_ids, it.history)
            rid = self.engine.add_request(it.prompt_ids, it.params, it.seed, it.prompt_key,
                                          samples=it.samples, prefixes=it.prefixes)
            out = self.engine.requests[rid]
            if out.error is not None:
                self.engine.pop_request(rid)
                finished.append(ItemResult(it.item_id, [], out.error))
                continue
            self._rid_item[rid], self._item_rid[it.item_id] = it.item_id, rid
        if step != self._step:  # after the items: their history is in the store when the drafter looks
            self._step = step
            if self.engine.proposer is not None:
                self.engine.proposer.begin(step)
        t0 = time.perf_counter()
        while self.engine.has_unfinished():
            for out in self.engine.step():
                finished.append(self._pop(out.request_id))
            if time.perf_counter() - t0 >= seconds or (until_finished and finished):
                break
        return self._report(finished)

    def abort(self, item_id: int, sample: int) -> tuple[list[int], list[float]] | None:
        """Take one unfinished sample away (to move it); returns its tokens and log-probs so far."""
        rid = self._item_rid.get(item_id)
        if rid is None:
            return None
        got = self.engine.abort(rid, sample)
        if got is not None and self.engine.requests[rid].finished:
            # Its other samples had all finished: nothing will step it again, so report it now.
            self._done.append(self._pop(rid))
        return got

    def _pop(self, rid: int) -> ItemResult:
        out = self.engine.pop_request(rid)
        item = self._rid_item.pop(rid)
        del self._item_rid[item]
        return ItemResult(item, out.outputs, out.error)

    def _report(self, finished: list[ItemResult]) -> WorkerReport:
        running, waiting = [], []
        for s in self.engine.sequences():
            item = self._rid_item[s.request_id]
            if s.status.name == "RUNNING":
                running.append((item, s.sample_index, len(s.output_ids)))
            else:
                waiting.append((item, s.sample_index))
        now = self._counters()
        stats: dict[str, Any] = {k: now[k] - self._mark.get(k, 0) for k in now}
        self._mark = now
        return WorkerReport(finished, running, waiting, stats)
