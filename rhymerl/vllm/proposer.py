"""HistoSpec inside vLLM: a ``custom_class`` speculative proposer that drafts from the history
rhymerl writes (a prompt's responses of earlier epochs) and from the live samples of the same
prompt, with the adaptive per-row draft length of :mod:`rhymerl.drafting`.

Any vLLM program can load it::

    LLM(path, speculative_config={"method": "custom_class",
                                  "model": "rhymerl.vllm.HistoSpecProposer",
                                  "num_speculative_tokens": 8},
        additional_config={"rhymerl": {"history": "RUN/checkpoints/step_000080/history.json.gz"}})
    llm.generate(prompts, SamplingParams(..., extra_args={"prompt_key": "17"}))  # the data row's key

``additional_config["rhymerl"]`` may also hold ``"speculative"``: a dict of
:class:`rhymerl.drafting.SpecConfig` fields (``sources``, ``length_policy``, ``pattern_max``...).
A request without a ``prompt_key`` is keyed by a hash of its prompt tokens
(:func:`prompt_hash_key`). vLLM verifies every draft with its rejection sampler; this class only
proposes, so what it drafts changes speed, never what is sampled (given a correct sampler:
:mod:`rhymerl.vllm.sampler_fix`).

vLLM hands a custom proposer only its ``VllmConfig`` and, per step, the batch's token rows; the
rows' request ids and sampling parameters live on the model runner that builds the proposer,
which is therefore found on the call stack at construction (:func:`_find_runner`).
"""
from __future__ import annotations

import hashlib
import logging
import sys
import time
from typing import Any

from rhymerl.drafting import HistoryStore, SpecConfig, SpecController, source_names
from rhymerl.drafting.length_policy import resolve
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.engine.sequence import Sequence, Status

log = logging.getLogger(__name__)

# Sources that draft from token occurrences (no model of their own): what runs inside vLLM.
INDEX_SOURCES = ("prompt_history", "global_history", "siblings", "ngram")


def prompt_hash_key(prompt_ids) -> str:
    """The key of a request that names no ``prompt_key``: a hash of its prompt tokens."""
    return "h:" + hashlib.blake2b(",".join(map(str, prompt_ids)).encode(), digest_size=12).hexdigest()


def proposer_config(k: int, extra: dict[str, Any] | None) -> SpecConfig:
    """The drafting config inside vLLM: history by default, index sources only, path drafts
    of at most ``k`` tokens (vLLM verifies chains), no time gate (vLLM schedules the drafts)."""
    fields = dict(extra or {})
    fields.setdefault("method", "history")
    cfg = SpecConfig.from_mapping(fields)
    if cfg.tree_budget > 0:
        raise ValueError("rhymerl.vllm.HistoSpecProposer: vLLM verifies draft chains, not trees "
                         f"(speculative.tree_budget={cfg.tree_budget}; set it to 0)")
    model = [n for n in source_names(cfg) if n not in INDEX_SOURCES]
    if model:
        raise ValueError(f"rhymerl.vllm.HistoSpecProposer drafts from history and live samples; the sources "
                         f"{model} run a model: use vLLM's own draft_model / eagle3 methods for those")
    return cfg.with_(max_draft=min(cfg.max_draft, k), gate=False, length_policy=resolve(cfg.length_policy, "vllm"))


def _find_runner() -> Any:
    """The vLLM model runner building this proposer (a caller on the stack)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    f = sys._getframe(1)
    while f is not None:
        obj = f.f_locals.get("self")
        if isinstance(obj, GPUModelRunner):
            return obj
        f = f.f_back
    raise RuntimeError("rhymerl.vllm.HistoSpecProposer must be built by vLLM's model runner "
                       "(speculative_config method 'custom_class')")


class HistoSpecProposer:
    """vLLM ``custom_class`` proposer over rhymerl's draft sources (see the module docstring)."""

    def __init__(self, vllm_config: Any, *, runner: Any = None) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        extra = dict((vllm_config.additional_config or {}).get("rhymerl", {}))
        self.cfg = proposer_config(self.k, extra.get("speculative"))
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        vocab = int(vllm_config.model_config.get_vocab_size())
        self.store = HistoryStore(max_rollouts=max(1, self.cfg.history_epochs))
        if extra.get("history"):
            self.store.replace_with(HistoryStore.load(extra["history"], vocab_size=vocab))
            log.info("rhymerl history: %d prompts from %s", len(self.store), extra["history"])
        self.controller = SpecController(self.cfg, self.store)
        self.runner = runner if runner is not None else _find_runner()
        self._seqs: dict[str, Sequence] = {}
        self._last: tuple[list[Sequence], list[str], list[int]] | None = None  # rows drafted last step
        self.propose_s = 0.0  # time inside propose (vLLM's step waits for it)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's hook for drafters with weights: this one has none."""

    # --- what the rollout worker pushes (through rhymerl.vllm.worker.RolloutExtension) ---------
    def put_history(self, rows: list[tuple[str, list[int], list]]) -> None:
        """Make each ``(key, prompt_ids, rollouts)`` that prompt's whole history (``HistoryStore.export``)."""
        for key, prompt_ids, rollouts in rows:
            self.store.put(key, prompt_ids, rollouts)

    def begin(self, step: int) -> None:
        self.controller.begin(step)

    def counters(self) -> dict[str, float]:
        c = self.controller
        return {"drafted": sum(c.drafted_by_source.values()), "accepted": sum(c.accepted_by_source.values()),
                "propose_s": self.propose_s, **c.counters()}

    # --- the per-step hook -----------------------------------------------------------------------
    def _sequence(self, req_id: str, row: int, tokens) -> Sequence:
        state = self.runner.requests[req_id]
        sp = state.sampling_params
        args = (sp.extra_args or {}) if sp is not None else {}
        n_prompt = int(self.runner.input_batch.num_prompt_tokens[row])
        prompt = [int(t) for t in tokens[:n_prompt]]
        key = args.get("prompt_key") or prompt_hash_key(prompt)
        gid = hash(args.get("group", key))  # siblings share it; unique among live requests
        max_tokens = sp.max_tokens if sp is not None and sp.max_tokens else self.max_model_len
        size = int(args.get("group_size", 1))
        seq = Sequence(gid, int(args.get("sample", 0)), prompt, SamplingParams(n=size, max_tokens=max_tokens),
                       0, str(key), status=Status.RUNNING, group_size=size)
        seq.limit = min(max_tokens, self.max_model_len - n_prompt)
        return seq

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu,
                slot_mappings: Any = None) -> list[list[int]]:
        t0 = time.perf_counter()
        try:
            return self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        finally:
            self.propose_s += time.perf_counter() - t0

    def _propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu) -> list[list[int]]:
        req_ids = list(self.runner.input_batch.req_ids)[: len(sampled_token_ids)]
        self._observe(sampled_token_ids, req_ids)
        live = set(req_ids)
        for gone in [r for r in self._seqs if r not in live]:  # finished or aborted since the last step
            seq = self._seqs.pop(gone)
            seq.status = Status.FINISHED
            self.controller.on_finish(seq)
        seqs, rows, new = [], [], []
        for i, rid in enumerate(req_ids):
            if not sampled_token_ids[i]:  # a partial prefill: nothing to continue yet
                continue
            n = int(num_tokens_no_spec[i])
            if n >= self.max_model_len:
                continue
            seq = self._seqs.get(rid)
            if seq is None:
                seq = self._seqs[rid] = self._sequence(rid, i, token_ids_cpu[i])
                new.append(seq)
            have = len(seq.prompt_ids) + len(seq.output_ids)
            if n > have:  # the list grows in place: live indices follow it
                seq.output_ids.extend(int(t) for t in token_ids_cpu[i, have:n])
            seqs.append(seq)
            rows.append(i)
        if new:
            self.controller.on_admit(new)
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        if not seqs:
            return out
        batch = self.controller.propose(seqs)
        if batch is None:
            self.controller.observe(seqs, [0] * len(seqs), [0] * len(seqs))
            return out
        lengths = batch.lengths
        toks = batch.tokens.tolist()
        drafted = []
        for b, i in enumerate(rows):
            d = lengths[b]
            out[i] = toks[b][:d]
            drafted.append(d)
        self._last = (seqs, [req_ids[i] for i in rows], drafted)
        return out

    def _observe(self, sampled_token_ids: list[list[int]], req_ids: list[str]) -> None:
        """Tell the controller what vLLM accepted of last step's drafts: a row that was drafted
        ``d`` tokens and emits ``m`` tokens now accepted ``m - 1`` of them."""
        if self._last is None:
            return
        seqs, rids, drafted = self._last
        self._last = None
        emitted = {rid: len(t) for rid, t in zip(req_ids, sampled_token_ids)}
        accepted = [min(d, max(0, emitted.get(rid, 1) - 1)) if d else 0 for rid, d in zip(rids, drafted)]
        self.controller.observe(seqs, drafted, accepted)
