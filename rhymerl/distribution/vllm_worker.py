"""A rollout worker backed by a vLLM engine: the same calls as :class:`RolloutWorker`
(``advance`` in slices, ``abort`` one sample to move it, weights and gate state), so the
coordinator's plans, tail migration and work stealing run over vLLM engines unchanged."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from rhymerl.distribution.work import ENGINE_COUNTERS, ItemResult, WorkerReport, WorkerSpec, WorkItem
from rhymerl.engine.outputs import CompletionOutput
from rhymerl.rollout_engines import get_engine, unsupported


@dataclass
class _Sample:
    item_id: int
    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    forwards: int = 0
    finish_reason: str | None = None
    prefilled: bool = False  # its request here has emitted its first token


@dataclass
class _Item:
    prompt_ids: list[int]
    samples: dict[int, _Sample]  # sample index -> state (those this worker runs)
    open: set[int]  # sample indices not finished here


class VllmRolloutWorker:
    """Runs work items on a :class:`rhymerl.vllm.engine.VllmEngine`."""

    def __init__(self, spec: WorkerSpec, engine: Any = None) -> None:
        from rhymerl.model.config import ModelConfig
        from rhymerl.vllm.engine import VllmEngine

        problems = unsupported(get_engine("vllm"), spec)
        if problems:
            raise ValueError("; ".join(problems))
        self.engine = engine if engine is not None else VllmEngine(spec.model_path, max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len,
                                 dtype=spec.dtype, speculative=spec.speculative, seed=spec.seed,
                                 timeout_s=spec.timeout_s, record_history=spec.record_history)
        self.model_config = ModelConfig.from_file(Path(spec.model_path) / "config.json")
        self.tokenizer = None
        if any((Path(spec.model_path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            from rhymerl.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(spec.model_path)
        self._items: dict[int, _Item] = {}
        self._rid: dict[tuple[int, int], str] = {}  # (item, sample) -> vLLM request id
        self._of: dict[str, _Sample] = {}
        self._serial = 0
        self._step: int | None = None
        self._done: list[ItemResult] = []  # finished by an abort, reported with the next advance
        self._stats = dict.fromkeys(ENGINE_COUNTERS, 0.0)
        self._proposer_mark: dict[str, float] = {}
        self._head_pushed = False  # a draft head trained beside the policy goes with every sync once pushed

    def ping(self) -> int:
        import os

        return os.getpid()

    # --- weights ----------------------------------------------------------------------------------
    def update_weights(self, named: Mapping[str, torch.Tensor]) -> None:
        from rhymerl.model import ours_to_hf

        from rhymerl.vllm.eagle3_head import PREFIX
        from rhymerl.vllm.engine import WeightSyncError

        learnt = sorted(n for n in named if n.startswith("draft_head."))
        if learnt:
            raise KeyError(f"update_weights: {learnt[0]!r} belongs to an online draft head, which vLLM does not run")
        head = {n[len(PREFIX):]: t for n, t in named.items() if n.startswith(PREFIX)}
        if self._head_pushed and not head:
            raise WeightSyncError("a policy sync without the Eagle3 head's weights, after earlier syncs pushed them: "
                                  "vLLM would draft with a stale head (push the head with every sync)")
        self.engine.load_weights(ours_to_hf({n: t for n, t in named.items() if not n.startswith(PREFIX)},
                                            self.model_config))
        if head:  # an Eagle3 head trained beside the policy: the drafter gets it with the same sync
            self.engine.load_draft_weights(head)
            self._head_pushed = True

    def update_weights_numpy(self, named: Mapping[str, Any]) -> None:
        self.update_weights({n: torch.from_numpy(a) for n, a in named.items()})

    def gate_state(self) -> dict[str, Any] | None:
        return None  # vLLM schedules its own drafts: there is no timing gate to keep

    def load_gate_state(self, state: dict[str, Any]) -> None:
        pass

    # --- work -------------------------------------------------------------------------------------
    def advance(self, items: list[WorkItem], step: int, seconds: float, until_finished: bool = False) -> WorkerReport:
        finished, self._done = [r for r in self._done if r.outputs], []
        history = [(it.prompt_key, it.prompt_ids, it.history) for it in items if it.prompt_key and it.history]
        if history:
            self.engine.put_history(history)
        if step != self._step:
            self._step = step
            if self.engine.speculative is not None:
                self.engine.begin(step)
        for it in items:
            err = self._add(it)
            if err is not None:
                finished.append(ItemResult(it.item_id, [], err))
        t0 = time.perf_counter()
        while self.engine.has_unfinished():
            ts = time.perf_counter()
            deltas = self.engine.step()
            self._stats["step_s"] += time.perf_counter() - ts
            if deltas:
                self._stats["forwards"] += 1
            for d in deltas:
                s = self._of.get(d.rid)
                if s is None:  # aborted since
                    continue
                self._absorb(s, d)
                if d.finish_reason is not None:
                    done = self._finish(d.rid, s)
                    if done is not None:
                        finished.append(done)
            if time.perf_counter() - t0 >= seconds or (until_finished and finished):
                break
        return self._report(finished)

    def _add(self, it: WorkItem) -> str | None:
        n = it.params.n
        indices = it.samples if it.samples is not None else list(range(n))
        item = self._items.get(it.item_id)
        if item is None:
            item = self._items[it.item_id] = _Item(list(it.prompt_ids), {}, set())
        group = f"{self._step}:{it.prompt_key or it.item_id}"
        try:
            for i in indices:
                tokens, lps = it.prefixes.get(i, ([], []))
                s = _Sample(it.item_id, i, list(tokens), list(lps))
                self._serial += 1
                rid = f"{it.item_id}.{i}.{self._serial}"
                self.engine.add(rid, it.prompt_ids, it.params, it.seed, i, prompt_key=it.prompt_key, group=group,
                                group_size=n, prefix=s.tokens)
                item.samples[i], item.open = s, item.open | {i}
                self._rid[(it.item_id, i)], self._of[rid] = rid, s
        except ValueError as e:  # vLLM refuses the request (a prompt past max_model_len, ...)
            for i in list(item.open):
                self._drop(it.item_id, i)
            del self._items[it.item_id]
            return f"{type(e).__name__}: {e}"
        return None

    def _absorb(self, s: _Sample, d) -> None:
        s.tokens += d.tokens
        s.logprobs += d.logprobs
        if d.tokens:
            s.forwards += 1
            st = self._stats
            st["generated"] += len(d.tokens)
            if not s.prefilled:
                s.prefilled = True
                st["prefills"] += 1
            else:  # a decode step: one verification forward emitted len(d.tokens) tokens
                st["decode_rows"] += 1
                st["accepted"] += len(d.tokens) - 1
        if d.finish_reason is not None:
            s.finish_reason = "length" if d.finish_reason == "length" else "stop"

    def _drop(self, item_id: int, i: int) -> None:
        rid = self._rid.pop((item_id, i), None)
        if rid is not None:
            self._of.pop(rid, None)
        item = self._items.get(item_id)
        if item is not None:
            item.open.discard(i)

    def _finish(self, rid: str, s: _Sample) -> ItemResult | None:
        self._drop(s.item_id, s.index)
        item = self._items[s.item_id]
        return self._pop(s.item_id) if not item.open else None

    def _pop(self, item_id: int) -> ItemResult:
        item = self._items.pop(item_id)
        outs = []
        for i in sorted(item.samples):
            s = item.samples[i]
            text = self.tokenizer.decode(s.tokens, skip_special_tokens=True) if self.tokenizer is not None else ""
            outs.append(CompletionOutput(i, s.tokens, text, s.finish_reason, s.logprobs, num_forwards=s.forwards))
        return ItemResult(item_id, outs)

    def abort(self, item_id: int, sample: int) -> tuple[list[int], list[float]] | None:
        """Take one unfinished sample away (to move it); returns its tokens and log-probs so far."""
        rid = self._rid.get((item_id, sample))
        if rid is None:
            return None
        s = self._of[rid]
        self.engine.abort([rid])
        self._drop(item_id, sample)
        item = self._items[item_id]
        del item.samples[sample]
        if not item.open:
            if item.samples:  # its other samples had all finished: nothing will step it again
                self._done.append(self._pop(item_id))
            else:
                del self._items[item_id]
        return list(s.tokens), list(s.logprobs)

    def _report(self, finished: list[ItemResult]) -> WorkerReport:
        running, waiting = [], []
        for (item_id, i), rid in self._rid.items():
            s = self._of[rid]
            if s.prefilled:
                running.append((item_id, i, len(s.tokens)))
            else:
                waiting.append((item_id, i))
        stats: dict[str, Any] = dict(self._stats)
        self._stats = dict.fromkeys(ENGINE_COUNTERS, 0.0)
        if self.engine.speculative is not None and self.engine.speculative.get("method") == "custom_class":
            now = self.engine.proposer_counters()
            delta = {k: v - self._proposer_mark.get(k, 0) for k, v in now.items() if k != "accepted"}
            delta["draft_s"] = delta.pop("propose_s", 0.0)  # drafting time, spent inside vLLM's step
            stats.update(delta)
            self._proposer_mark = now
        return WorkerReport(finished, running, waiting, stats)

    def close(self) -> None:
        self.engine.close()
