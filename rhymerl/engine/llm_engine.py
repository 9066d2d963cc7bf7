"""The engine loop: add requests, ``step()`` until done. One step = schedule -> run -> postprocess."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rhymerl.engine.draft import Proposer, as_batch
from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.model_runner import ModelRunner
from rhymerl.engine.outputs import CompletionOutput, RequestOutput
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.engine.scheduler import Scheduler
from rhymerl.engine.sequence import Sequence
from rhymerl.model import CausalLM


def accepted_per_forward(decode_rows: float, accepted: float) -> float:
    """Tokens one sequence emits per decode forward: each row scored emits one token plus the
    drafts it accepted. 1.0 where nothing was decoded (plain decoding's rate)."""
    return (decode_rows + accepted) / decode_rows if decode_rows else 1.0


@dataclass
class EngineStats:
    """Counters since the last reset; machine-independent where possible."""

    forwards: int = 0  # decode forward passes (prefills counted apart)
    prefills: int = 0
    generated: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    step_s: float = 0.0
    # Rows scored by decode forwards (the sum of the batch sizes): a counter, not a list per
    # step, so a long-lived engine's stats stay the same size.
    decode_rows: int = 0

    @property
    def accepted_per_forward(self) -> float:
        """Tokens emitted per sequence per decode forward (1.0 without speculation)."""
        return accepted_per_forward(self.decode_rows, self.accepted)


def kv_capacity(max_model_len: int, proposer: Proposer | None, invariant: bool) -> int:
    """Cached positions per slot: the model length, room for a draft tree's nodes, and (with
    invariant numerics, which read keys in whole chunks) rounded up to whole key chunks."""
    capacity = max_model_len + ((proposer.max_nodes + 1) if proposer is not None else 1)
    if invariant:
        from rhymerl.model.invariant import KEY_CHUNK

        capacity = -(-capacity // KEY_CHUNK) * KEY_CHUNK
    return capacity


class LLMEngine:
    def __init__(self, model: CausalLM, *, num_slots: int, max_model_len: int, device: torch.device,
                 dtype: torch.dtype, eos_token_ids: list[int], proposer: Proposer | None = None,
                 detokenize=None, invariant: bool = False) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.max_model_len = max_model_len
        self.proposer = proposer
        self.cache = KVCache(model.config, num_slots, kv_capacity(max_model_len, proposer, invariant), device,
                             dtype, value_ones=invariant)
        self.runner = ModelRunner(model, self.cache, device, invariant=invariant,
                                  keep_hidden=proposer is not None and proposer.wants_hidden)
        if proposer is not None and proposer.wants_cost_model:
            from rhymerl.engine.cost_model import calibrate, calibrated

            # Measured on this model and device before any request holds a slot, with the forward
            # the engine runs (once per process for this shape, numerics and cache).
            width = proposer.max_nodes + 1
            key = (repr(model.config), str(device), str(dtype), torch.get_num_threads(), invariant,
                   self.runner.keep_hidden, num_slots, self.cache.capacity, width)
            proposer.attach_cost_model(calibrated(key, lambda: calibrate(self.runner.forward, self.cache, device,
                                                                          num_slots, width)))
        self.scheduler = Scheduler(self.cache)
        self.eos_token_ids = list(eos_token_ids)
        self.detokenize = detokenize
        self.requests: dict[int, RequestOutput] = {}
        self._seqs: dict[int, list[Sequence]] = {}
        self._next_id = 0
        self.stats = EngineStats()

    def add_request(self, prompt_ids: list[int], params: SamplingParams, seed: int,
                    prompt_key: str | None = None, *, samples: list[int] | None = None,
                    prefixes: dict[int, tuple[list[int], list[float]]] | None = None) -> int:
        """Queue a request; returns its id.

        ``samples`` runs only these sample indices of the ``params.n`` (default: all); the
        others run elsewhere. ``prefixes`` maps a sample index to the tokens (and log-probs)
        it already generated on another worker: its K/V is recomputed and it continues with
        the same seeded draws, so its tokens are those it would have had without the move.
        """
        rid = self._next_id
        self._next_id += 1
        out = RequestOutput(request_id=rid, prompt_token_ids=list(prompt_ids), prompt_key=prompt_key)
        self.requests[rid] = out
        if len(prompt_ids) == 0:
            out.error = "empty prompt"
            return rid
        if len(prompt_ids) >= self.max_model_len:
            out.error = (f"prompt of {len(prompt_ids)} tokens leaves no room to generate within "
                         f"max_model_len={self.max_model_len}")
            return rid
        idx = list(range(params.n)) if samples is None else sorted(samples)
        prefixes = prefixes or {}
        seqs = []
        for i in idx:
            s = Sequence(rid, i, list(prompt_ids), params, seed, prompt_key, group_size=len(idx))
            if prefixes.get(i) and prefixes[i][0]:
                toks, lps = prefixes[i]
                s.output_ids, s.logprobs, s.resumed = list(toks), list(lps), True
            seqs.append(s)
        out.outputs = [CompletionOutput(i, [], "", None) for i in idx]
        self._seqs[rid] = seqs
        self.scheduler.add(seqs)
        return rid

    def abort(self, rid: int, sample_index: int) -> tuple[list[int], list[float]] | None:
        """Stop one unfinished sample and return what it generated so far (None if it had finished)."""
        seq = next((s for s in self._seqs.get(rid, []) if s.sample_index == sample_index), None)
        if seq is None or seq.finish_reason is not None:
            return None
        self.scheduler.remove(seq)
        if self.proposer is not None:
            self.proposer.on_abort(seq)
        out = self.requests[rid]
        out.outputs = [o for o in out.outputs if o.index != sample_index]
        self._seqs[rid] = [s for s in self._seqs[rid] if s is not seq]
        return list(seq.output_ids), list(seq.logprobs)

    def sequences(self) -> list[Sequence]:
        """Every unfinished sequence, waiting or running."""
        return list(self.scheduler.running) + list(self.scheduler.waiting)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Admit and prefill new requests, run one decode forward, retire finished ones.

        Returns the requests that finished in this step.
        """
        t0 = time.perf_counter()
        retired: list[Sequence] = []  # this step's finished sequences, at prefill or in the decode
        groups = self.scheduler.admit()
        if groups:
            self.runner.prefill(groups, self._cached_prompts(groups))
            self.stats.prefills += 1
            if self.proposer is not None:
                self.proposer.on_admit([s for g in groups for s in g])
            new = [s for g in groups for s in g if not s.resumed]
            self.stats.generated += len(new)
            stopped = [s for s in new if self._check_stop(s, 1)]  # the first token ended it
            self._retire(stopped)
            retired += stopped
        running = self.scheduler.running
        if running:
            finished: list[Sequence] = []
            drafts = None
            td = time.perf_counter()
            if self.proposer is not None:
                drafts = as_batch(self.proposer.propose(running))
                self.stats.draft_s += time.perf_counter() - td
            B = len(running)
            width = 1 + drafts.width if drafts is not None else 1
            res = self.runner.decode(running, drafts)
            self.stats.forwards += 1
            self.stats.decode_rows += len(running)
            for s, toks, lps, nd, na in zip(running, res.tokens, res.logprobs, res.drafted, res.accepted):
                s.num_forwards += 1
                s.num_drafted += nd
                s.num_accepted += na
                before = len(s.output_ids)
                s.output_ids.extend(toks)
                s.logprobs.extend(lps)
                self.stats.drafted += nd
                if self._check_stop(s, len(toks)):
                    finished.append(s)
                self.stats.generated += len(s.output_ids) - before
                self.stats.accepted += max(0, len(s.output_ids) - before - 1)
            if self.proposer is not None:
                self.proposer.observe(running, res.drafted, res.accepted)
                self.proposer.observe_time(B, width, time.perf_counter() - td)  # drafting + forward + verification
            self._retire(finished)
            retired += finished
        self.stats.step_s += time.perf_counter() - t0
        done = []
        for rid in {s.request_id for s in retired}:
            if self.requests[rid].finished:
                done.append(self.requests[rid])
        return done

    def _cached_prompts(self, groups: list[list[Sequence]]) -> dict[int, int]:
        """Groups whose prompt is already in the cache: a sibling admitted in an earlier step
        still runs (its slot holds the prompt's K/V) and the prompt's logits were kept.
        Kept logits are dropped once no sample of their request waits."""
        new = {id(s) for g in groups for s in g}
        holder: dict[int, int] = {}
        for s in self.scheduler.running:
            if id(s) not in new and s.request_id in self.runner.prompt_logits:
                holder.setdefault(s.request_id, s.slot)
        cached = {gi: holder[g[0].request_id] for gi, g in enumerate(groups)
                  if not g[0].resumed and g[0].request_id in holder}
        kept = self.runner.prompt_logits
        if kept:
            still = {s.request_id for s in self.scheduler.waiting} | {g[0].request_id for g in groups}
            for rid in [r for r in kept if r not in still]:
                del kept[rid]
                self.runner.prompt_hidden.pop(rid, None)
        return cached

    def _check_stop(self, s: Sequence, n_new: int) -> bool:
        """Truncate at a stop token, max_tokens or max_model_len among the ``n_new`` new tokens."""
        stops = s.stop_ids
        if stops is None:
            p = s.params
            stops = s.stop_ids = frozenset(p.stop_token_ids) | frozenset(() if p.ignore_eos else self.eos_token_ids)
            s.limit = min(p.max_tokens, self.max_model_len - len(s.prompt_ids))
        start = len(s.output_ids) - n_new
        limit = s.limit
        for i in range(start, len(s.output_ids)):
            if s.output_ids[i] in stops:
                self._finish(s, i + 1, "stop")
                return True
            if i + 1 >= limit:
                self._finish(s, i + 1, "length")
                return True
        return False

    def _finish(self, s: Sequence, keep: int, reason: str) -> None:
        del s.output_ids[keep:]
        del s.logprobs[keep:]
        s.finish_reason = reason
        out = next(o for o in self.requests[s.request_id].outputs if o.index == s.sample_index)
        out.token_ids = list(s.output_ids)
        out.text = self.detokenize(s.output_ids) if self.detokenize else ""
        out.finish_reason = reason
        out.logprobs = list(s.logprobs) if s.params.logprobs else None
        out.num_forwards, out.num_drafted, out.num_accepted = s.num_forwards, s.num_drafted, s.num_accepted
        out.finished_at = time.perf_counter()

    def _retire(self, finished: list[Sequence]) -> None:
        if not finished:
            return
        self.scheduler.retire(finished)
        if self.proposer is not None:
            for s in finished:
                self.proposer.on_finish(s)

    def pop_request(self, rid: int) -> RequestOutput:
        self._seqs.pop(rid, None)
        self.runner.prompt_logits.pop(rid, None)
        self.runner.prompt_hidden.pop(rid, None)
        return self.requests.pop(rid)
