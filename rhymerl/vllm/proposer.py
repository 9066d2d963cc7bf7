"""HistoSpec inside vLLM: a ``custom_class`` speculative proposer that drafts from a prompt's
responses of earlier epochs, from every response finished so far (any prompt's), and from the
live samples of the same prompt (its own output included), with the adaptive per-row draft
length of :mod:`rhymerl.drafting`.

Any vLLM program can load it, with one config line::

    LLM(path, speculative_config={"method": "custom_class",
                                  "model": "rhymerl.vllm.HistoSpecProposer",
                                  "num_speculative_tokens": 8})
    llm.generate(prompts, SamplingParams(..., max_tokens=512, extra_args={"prompt_key": f"q{i}"}))  # key optional, one per prompt

It records history itself: each finished response goes under its prompt's key
(``extra_args["prompt_key"]``, else a hash of the prompt's tokens: :func:`prompt_hash_key`), a
prompt's rollout (its samples live together) is committed when its last sample finishes, and
the last ``history_epochs`` rollouts per prompt are kept within a token budget, oldest first
out. So an RL framework that calls ``generate`` over the same prompts epoch after epoch drafts
from the earlier epochs with no code of ours in its loop. ``additional_config["rhymerl"]``
(:class:`rhymerl.vllm.settings.ProposerSettings`: typed, an unknown key refused by name):

- ``history``: a history file a rhymerl run wrote (``RUN/checkpoints/step_N/history.json.gz``);
- ``history_tokens``: the token budget (default :data:`rhymerl.vllm.settings.HISTORY_TOKENS`);
- ``record``: false turns self-recording off;
- ``history_dir``: a folder several engines share (one per GPU, as verl and OpenRLHF run them):
  each appends what it records and reads the others' (:mod:`rhymerl.vllm.shared_history`), at
  most every ``history_sync_s`` seconds (5), the folder kept under ``history_dir_bytes`` (1 GiB);
- ``speculative``: :class:`rhymerl.drafting.SpecConfig` fields (``history_epochs``, ``sources``...);
  its ``gate`` (on by default) ends each row's draft where this engine's measured step cost and
  its source's measured acceptance say further tokens stop paying
  (:class:`rhymerl.vllm.draft_cutoff.DraftCutoff`); false drafts as far as the index is confident.

A rhymerl trainer pushes each prompt's history before its step (``put_history``): a pushed
prompt's history replaces what was recorded for it. vLLM verifies every draft with its
rejection sampler; this class only proposes, so what it drafts changes speed, never what is
sampled, given a correct sampler: where the rejection sampler's expansion probes wrong
(:mod:`rhymerl.vllm.sampler_fix`), requests at temperature > 0 get no drafts, with one warning.

vLLM hands a custom proposer only its ``VllmConfig`` and, per step, the batch's token rows; the
rows' request ids and sampling parameters live on the model runner that builds the proposer,
which is therefore found on the call stack at construction (:func:`_find_runner`).
"""
from __future__ import annotations

import hashlib
import logging
import sys
import time
from typing import Any, Callable

from rhymerl.drafting import HistoryStore, SpecConfig, SpecController, get_source, source_names
from rhymerl.drafting.config import renamed_keys
from rhymerl.drafting.length_policy import resolve
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.engine.sequence import Sequence, Status
from rhymerl.rollout_engines import get_engine, unsupported
from rhymerl.vllm.draft_cutoff import DraftCutoff, token_confidence
from rhymerl.vllm.settings import ProposerSettings
from rhymerl.vllm.shared_history import SharedHistory

log = logging.getLogger(__name__)

def prompt_hash_key(prompt_ids) -> str:
    """The key of a request that names no ``prompt_key``: a hash of its prompt tokens."""
    return "h:" + hashlib.blake2b(",".join(map(str, prompt_ids)).encode(), digest_size=12).hexdigest()


def proposer_config(k: int, extra: dict[str, Any] | None) -> SpecConfig:
    """The drafting config inside vLLM: history by default, index sources only, path drafts of
    at most ``k`` tokens (vLLM's ``num_speculative_tokens``, the one draft-length setting there;
    vLLM verifies chains). ``gate`` is kept as given: inside vLLM it means the
    :class:`rhymerl.vllm.draft_cutoff.DraftCutoff`, fitted to vLLM's own steps, not the native gate."""
    fields = renamed_keys(extra or {}, "speculative")
    fields.setdefault("method", "history")
    cfg = SpecConfig.from_mapping(fields)
    problems = unsupported(get_engine("vllm"), cfg)
    if problems:
        raise ValueError("rhymerl.vllm.HistoSpecProposer: " + "; ".join(problems))
    model = [n for n in source_names(cfg) if get_source(n).runs_a_model]  # index sources only run inside vLLM
    if model:
        raise ValueError(f"rhymerl.vllm.HistoSpecProposer drafts from history and live samples; the sources "
                         f"{model} run a model: use vLLM's own draft_model / eagle3 methods for those")
    if "index_draft_tokens" in fields and cfg.index_draft_tokens != k:
        raise ValueError(f"rhymerl.vllm.HistoSpecProposer: the draft length is vLLM's num_speculative_tokens ({k}); "
                         f"remove index_draft_tokens={cfg.index_draft_tokens} from additional_config")
    return cfg.with_(index_draft_tokens=k, length_policy=resolve(cfg.length_policy, "vllm"))


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


def _fingerprint(model_config: Any) -> str | None:
    """The served tokenizer's fingerprint, which every shared segment carries and is read by
    (None where it cannot be loaded: then the vocabulary size alone guards the folder)."""
    from rhymerl.tokenizer import load_tokenizer, tokenizer_fingerprint

    try:
        return tokenizer_fingerprint(load_tokenizer(model_config.tokenizer))
    except Exception as e:  # noqa: BLE001 - sharing history must never stop the engine
        log.warning("rhymerl history_dir: cannot load the tokenizer %s (%s); segments are checked by "
                    "vocabulary size only", getattr(model_config, "tokenizer", None), e)
        return None


class HistoSpecProposer:
    """vLLM ``custom_class`` proposer over rhymerl's draft sources (see the module docstring)."""

    def __init__(self, vllm_config: Any, *, runner: Any = None) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        extra = ProposerSettings.from_mapping((vllm_config.additional_config or {}).get("rhymerl"))
        self.cfg = proposer_config(self.k, extra.speculative)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        vocab = int(vllm_config.model_config.get_vocab_size())
        budget = extra.history_tokens
        self.store = HistoryStore(max_rollouts=max(1, self.cfg.history_epochs), max_total_tokens=budget)
        if extra.history:
            # Bounded like the store: a file never unzips past what its tokens could take as JSON.
            self.store.replace_with(HistoryStore.load(extra.history, vocab_size=vocab, max_total_tokens=budget,
                                                      max_bytes=16 * budget + (1 << 20)))
            log.info("rhymerl history: %d prompts from %s", len(self.store), extra.history)
        # Several engines: what each records goes through a shared folder to the others; a
        # folder that cannot be made costs the sharing (drafts), never the engine.
        self.shared = None
        if extra.history_dir:
            try:
                self.shared = SharedHistory(extra.history_dir, self.store, vocab_size=vocab,
                                            interval_s=extra.history_sync_s, max_bytes=extra.history_dir_bytes,
                                            tokenizer_fingerprint=_fingerprint(vllm_config.model_config))
            except OSError as e:
                log.warning("rhymerl history_dir %s: %s; this engine drafts from its own history only",
                            extra.history_dir, e)
        self.recorder = Recorder(self.store, self.shared.record if self.shared else None) if extra.record else None
        # Each row's draft ends where this engine's costs say its tokens stop paying (draft_cutoff.py).
        self.cutoff = DraftCutoff(self.k) if self.cfg.gate else None
        self._t_end: float | None = None  # when the last propose call returned (vLLM's step runs between)
        self._verified = (0, 0)  # what the step after the last call verified: its rows, their drafted tokens
        # The cutoff gates here, from each drafted token's confidence (the index's probabilities).
        self.controller = SpecController(self.cfg.with_(gate=False), self.store, with_probs=self.cutoff is not None)
        self.runner = runner if runner is not None else _find_runner()
        log.info("rhymerl HistoSpec: proposing inside vLLM's %s (the V1 model runner)", type(self.runner).__name__)
        self._seqs: dict[str, Sequence] = {}
        self._groups = _Groups()
        self._last: tuple[list[Sequence], list[str], list[int], list, Any] | None = None  # rows drafted last step
        self._began = False  # a rhymerl trainer labels rollouts with its steps (begin)
        self._sampler_ok: bool | None = None  # the rejection sampler's expansion probed correct here
        self.propose_s = 0.0  # time inside propose (vLLM's step waits for it)
        self._step_s: float | None = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's hook for drafters with weights: this one has none."""

    # --- what the rollout worker pushes (through rhymerl.vllm.worker_extension.RolloutExtension) -
    def put_history(self, rows: list[tuple[str, list[int], list]]) -> None:
        """Make each ``(key, prompt_ids, rollouts)`` that prompt's whole history (``HistoryStore.export``)."""
        for key, prompt_ids, rollouts in rows:
            self.store.put(key, prompt_ids, rollouts)

    def begin(self, step: int) -> None:
        self._began = True
        self.controller.begin(step)

    def counters(self) -> dict[str, float]:
        c = self.controller
        return {"drafted": sum(c.drafted_by_source.values()), "accepted": sum(c.accepted_by_source.values()),
                "propose_s": self.propose_s, **c.counters()}

    def live_state(self) -> dict[str, int]:
        """Sizes of everything this proposer holds per request (a soak test reads them)."""
        sib = next((s for s in self.controller.sources if s.name == "siblings"), None)
        return {"seqs": len(self._seqs), "groups": len(self._groups.admitted),
                "sibling_indices": len(getattr(sib, "_live", ())), "recording": len(self.recorder.open)
                if self.recorder else 0, "history_tokens": self.store.total_tokens}

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
        temperature = float(sp.temperature or 0.0) if sp is not None else 0.0
        # A request that names no sample (vLLM's n>1 children, verl, TRL, plain generate calls):
        # each distinct request of the group gets the next index, so every sibling is indexed.
        sample = int(args["sample"]) if "sample" in args else self._groups.admitted.get(gid, 0)
        seq = Sequence(gid, sample, prompt,
                       SamplingParams(n=size, max_tokens=max_tokens, temperature=temperature),
                       0, str(key), status=Status.RUNNING, group_size=size)
        seq.limit = min(max_tokens, self.max_model_len - n_prompt)
        return seq

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu,
                slot_mappings: Any = None) -> list[list[int]]:
        t0 = time.perf_counter()
        self._step_s = t0 - self._t_end if self._t_end is not None else None
        try:
            return self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        finally:
            self._t_end = time.perf_counter()
            self.propose_s += self._t_end - t0

    def _propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu) -> list[list[int]]:
        req_ids = list(self.runner.input_batch.req_ids)[: len(sampled_token_ids)]
        self._observe(sampled_token_ids, req_ids)
        self._retire(set(req_ids))
        if self.shared is not None:
            self.shared.tick()
        seqs, rows, prefilled = self._rows(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, req_ids)
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        if self.cutoff is not None and self._step_s is not None and not prefilled:
            self.cutoff.observe_step(*self._verified, self._step_s)  # a step without prefills: decode cost alone
        self._verified = (len(req_ids), 0)
        if not seqs:
            return out
        batch = self.controller.propose(seqs)
        if batch is None:
            self.controller.observe(seqs, [0] * len(seqs), [0] * len(seqs))
            return out
        lengths, toks = batch.lengths, batch.tokens.tolist()
        sources = self.controller.row_sources()
        confidence, keep = None, lengths
        if self.cutoff is not None:
            confidence = token_confidence(self.controller.row_probs(), self.controller.row_support())
            keep = self.cutoff.lengths(len(req_ids), sources, lengths, confidence)
        safe_at_temperature = self._sampler_is_correct()
        drafted = []
        for b, i in enumerate(rows):
            d = keep[b] if safe_at_temperature or seqs[b].params.temperature == 0 else 0
            out[i] = toks[b][:d]
            drafted.append(d)
        self._last = (seqs, [req_ids[i] for i in rows], drafted, sources, confidence)
        self._verified = (len(req_ids), sum(drafted))
        return out

    def _retire(self, live: set[str]) -> None:
        """Requests no longer in the batch: finished or aborted (gone from the runner) retire;
        a preempted one (still the runner's) keeps its state for when it returns."""
        requests = self.runner.requests
        for gone in [r for r in self._seqs if r not in live and r not in requests]:
            seq = self._seqs.pop(gone)
            seq.status = Status.FINISHED
            # The sibling index goes when its last member here retires, however many of the
            # group's samples this engine ran (a migrated subset, or all of them).
            seq.group_size = self._groups.retire(seq.request_id)
            self.controller.on_finish(seq)
            if self.recorder is not None:
                self.recorder.finish(seq, self.controller.step if self._began else None)

    def _rows(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
              req_ids: list[str]) -> tuple[list[Sequence], list[int], bool]:
        """The batch's rows that can draft, their sequences brought up to date, and whether the
        step just done ran a prefill (a request new here, or part of one)."""
        seqs, rows, new = [], [], []
        partial = False
        for i, rid in enumerate(req_ids):
            if not sampled_token_ids[i]:  # a partial prefill: nothing to continue yet
                partial = True
                continue
            n = int(num_tokens_no_spec[i])
            seq = self._seqs.get(rid)
            if seq is None:
                seq = self._seqs[rid] = self._sequence(rid, i, token_ids_cpu[i])
                self._groups.admit(seq.request_id)
                if self.recorder is not None:
                    self.recorder.admit(seq)
                new.append(seq)
            have = len(seq.prompt_ids) + len(seq.output_ids)
            if n > have:  # the list grows in place: live indices follow it
                seq.output_ids.extend(int(t) for t in token_ids_cpu[i, have:n])
            if n >= self.max_model_len:
                continue
            seqs.append(seq)
            rows.append(i)
        if new:
            self.controller.on_admit(new)
        return seqs, rows, partial or bool(new)

    def _sampler_is_correct(self) -> bool:
        if self._sampler_ok is None:
            from rhymerl.vllm.sampler_fix import CORRECT, probe_rejection_sampler

            probe = probe_rejection_sampler(getattr(self.runner, "device", "cpu"))
            self._sampler_ok = probe == CORRECT
            if not self._sampler_ok:
                log.warning("rhymerl.vllm.HistoSpecProposer: this vLLM's rejection sampler expands per-request "
                            "temperature/top-k/top-p wrongly (probe: %s; vLLM issue #55005 on CPU builds, corrected "
                            "by rhymerl's vllm.general_plugins entry point where it loads): requests at temperature "
                            "> 0 get no drafts here, so they sample the right distribution without speculation", probe)
        return self._sampler_ok

    def _observe(self, sampled_token_ids: list[list[int]], req_ids: list[str]) -> None:
        """Tell the controller what vLLM accepted of last step's drafts: a row that was drafted
        ``d`` tokens and emits ``m`` tokens now accepted ``m - 1`` of them."""
        if self._last is None:
            return
        seqs, rids, drafted, sources, confidence = self._last
        self._last = None
        emitted = {rid: len(t) for rid, t in zip(req_ids, sampled_token_ids)}
        accepted = [min(d, max(0, emitted.get(rid, 1) - 1)) if d else 0 for rid, d in zip(rids, drafted)]
        self.controller.observe(seqs, drafted, accepted)
        if self.cutoff is not None:
            self.cutoff.observe_drafts(sources, drafted, accepted, confidence)


class _Groups:
    """Per sibling group (a prompt's samples in one rollout): members admitted since its live
    index was made, and members still running here."""

    def __init__(self) -> None:
        self.admitted: dict[int, int] = {}
        self.alive: dict[int, int] = {}

    def admit(self, gid: int) -> None:
        self.admitted[gid] = self.admitted.get(gid, 0) + 1
        self.alive[gid] = self.alive.get(gid, 0) + 1

    def retire(self, gid: int) -> int:
        """The group's size as the sibling source must count it: every member admitted here, so
        its index is dropped exactly when the last of them retires."""
        size = self.admitted.get(gid, 1)
        self.alive[gid] = self.alive.get(gid, 1) - 1
        if self.alive[gid] <= 0:
            self.admitted.pop(gid, None)
            self.alive.pop(gid, None)
        return size


class Recorder:
    """Self-recorded history: a prompt's samples that run together make one rollout, committed to
    the store (under the prompt's key) when the last of them finishes."""

    def __init__(self, store: HistoryStore, on_commit: Callable[[str, list[int], list[list[int]], int], None]
                 | None = None) -> None:
        self.store, self.on_commit = store, on_commit
        self.open: dict[str, tuple[list[int], int, list[list[int]]]] = {}  # key -> (prompt, live, responses)

    def admit(self, seq: Sequence) -> None:
        prompt, live, responses = self.open.get(seq.prompt_key, (seq.prompt_ids, 0, []))
        self.open[seq.prompt_key] = (prompt, live + 1, responses)

    def finish(self, seq: Sequence, step: int | None) -> None:
        """``step``: the trainer's step (its labels), or None (a label of this recorder's own)."""
        got = self.open.get(seq.prompt_key)
        if got is None:
            return
        prompt, live, responses = got
        responses.append(list(seq.output_ids))
        if live > 1:
            self.open[seq.prompt_key] = (prompt, live - 1, responses)
            return
        del self.open[seq.prompt_key]
        if step is None:  # a new rollout of this prompt: after every one it has (a file's included)
            step = self.store.next_step(seq.prompt_key)
        self.store.add(seq.prompt_key, prompt, responses, step)
        if self.on_commit is not None:
            self.on_commit(seq.prompt_key, prompt, responses, step)
