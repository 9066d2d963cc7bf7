"""``LLM``: the user-facing rollout engine, vLLM-style. It sits above the engine and the
drafters it composes (the engine knows drafters only as a ``Proposer``)."""
from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from tqdm.auto import tqdm

from rhymerl.device import resolve_device, resolve_dtype
from rhymerl.drafting import HistoryStore, SpecConfig, build_proposer, uses_history
from rhymerl.engine.draft import Proposer
from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.llm_engine import LLMEngine, kv_capacity
from rhymerl.engine.outputs import RequestOutput
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.model import CausalLM, load_pretrained


class LLM:
    """Generate with continuous batching over a preallocated KV cache.

    Args:
        model: an HF-format folder (weights and tokenizer) or a :class:`CausalLM`.
        tokenizer: needed with a model object when prompts are strings or text is wanted.
        max_num_seqs: the most sequences decoded together.
        max_model_len: prompt plus response tokens per sequence.
        kv_cache_tokens: KV memory budget in tokens (default: room for ``max_num_seqs``
            full-length sequences); fewer slots than ``max_num_seqs`` make requests wait.
        speculative: ``None``, a :class:`rhymerl.drafting.SpecConfig` or its dict, such as
            ``{"method": "history", "index_draft_tokens": 16}`` or ``{"method": "draft_model",
            "draft_model": PATH}``, or a ready :class:`Proposer`. With history sources this
            LLM records each request's responses under its prompt key after ``generate``.
        seed: seeds the draws of requests whose ``SamplingParams.seed`` is None.
        invariant: shape-invariant numerics (:mod:`rhymerl.model.invariant`): a position's
            logits are bitwise the same at any batch size and slot, in prefill, decode and
            verification, so speculation never changes a token, not even at a float tie.
    """

    def __init__(self, model: str | Path | CausalLM, *, tokenizer: Any = None, max_num_seqs: int = 64,
                 max_model_len: int = 512, kv_cache_tokens: int | None = None, device: str = "auto",
                 dtype: str | torch.dtype = "float32", speculative: Mapping[str, Any] | Proposer | None = None,
                 seed: int = 0, invariant: bool = False) -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        if isinstance(model, (str, Path)):
            from rhymerl.model.gguf import resolve_model

            model = resolve_model(model)  # a named model or a .gguf: its converted folder
        self._path = str(model) if isinstance(model, (str, Path)) else None
        if isinstance(model, (str, Path)):
            from rhymerl.tokenizer import load_tokenizer

            if tokenizer is None and any((Path(model) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
                tokenizer = load_tokenizer(model)  # a weights-only folder generates token ids
            model = load_pretrained(model, device=self.device, dtype=self.dtype)
        else:
            model = model.to(device=self.device, dtype=self.dtype)
        self.model: CausalLM = model.eval()
        self.tokenizer = tokenizer
        self.history = None  # the store this LLM records into, when its drafts read history
        proposer = self._build_proposer(speculative)
        capacity = kv_capacity(max_model_len, proposer, invariant)
        num_slots = max_num_seqs if kv_cache_tokens is None else min(max_num_seqs, kv_cache_tokens // capacity)
        if num_slots < 1:
            raise ValueError(f"kv_cache_tokens={kv_cache_tokens} cannot hold one sequence of "
                             f"max_model_len={max_model_len} (+{capacity - max_model_len} draft headroom)")
        eos: list[int] = []
        if tokenizer is not None:
            from rhymerl.tokenizer import eos_ids

            eos = eos_ids(tokenizer)
        elif model.config.eos_token_id is not None:
            e = model.config.eos_token_id
            eos = list(e) if isinstance(e, list) else [e]
        detok = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer is not None else None
        self.engine = LLMEngine(self.model, num_slots=num_slots, max_model_len=max_model_len,
                                device=self.device, dtype=self.dtype, eos_token_ids=eos,
                                proposer=proposer, detokenize=detok, invariant=invariant)
        self._rng = random.Random(seed)
        self._calls = 0

    def _build_proposer(self, speculative: Mapping[str, Any] | Proposer | None) -> Proposer | None:
        if speculative is None:
            return None
        if isinstance(speculative, Proposer):
            return speculative

        cfg = SpecConfig.from_mapping(speculative)  # type: ignore[arg-type]
        if cfg.method == "none":
            return None
        if uses_history(cfg):
            # A standalone LLM is its own history's one writer: each finished request's
            # samples, recorded after generate() under the request's prompt key.
            self.history = HistoryStore(max_rollouts=max(1, cfg.history_epochs))
        return build_proposer(cfg, self.history, target=self.model, target_path=self._path)

    @property
    def proposer(self) -> Proposer | None:
        return self.engine.proposer

    @property
    def kv_cache_bytes(self) -> int:
        c = self.engine.cache
        return c.num_slots * c.capacity * KVCache.bytes_per_token(self.model.config, self.dtype)

    def _encode(self, prompt: str | list[int] | list[dict]) -> list[int]:
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            return list(prompt)  # type: ignore[arg-type]
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer: pass LLM(..., tokenizer=...)")
        from rhymerl.tokenizer import encode_prompt

        return encode_prompt(self.tokenizer, prompt)  # type: ignore[arg-type]

    def generate(self, prompts: Iterable[str | list[int]], sampling_params: SamplingParams |
                 list[SamplingParams] | None = None, *, prompt_keys: list[str] | None = None,
                 step: int | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of ``prompts``.

        ``prompt_keys`` name each prompt stably across calls (a dataset index): drafters
        that learn from history look it up by this key. ``step`` labels this rollout in the
        history (default: a counter of ``generate`` calls).
        """
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        if prompt_keys is not None and len(prompt_keys) != len(prompts):
            raise ValueError(f"{len(prompt_keys)} prompt_keys for {len(prompts)} prompts")
        self._calls += 1
        if self.proposer is not None:
            self.proposer.begin(step if step is not None else self._calls)
        rids = []
        for i, (pr, sp) in enumerate(zip(prompts, plist)):
            seed = sp.seed if sp.seed is not None else self._rng.getrandbits(62)
            key = prompt_keys[i] if prompt_keys is not None else None
            rids.append(self.engine.add_request(self._encode(pr), sp, seed, key))
        bar = tqdm(total=len(rids), desc="rollout", unit="req", disable=not use_tqdm or not sys.stderr.isatty(), leave=False)
        done = sum(self.engine.requests[r].finished for r in rids)
        bar.update(done)
        while self.engine.has_unfinished():
            finished = self.engine.step()
            bar.update(len(finished))
        bar.close()
        outs = [self.engine.pop_request(r) for r in rids]
        if self.history is not None and prompt_keys is not None:
            label = step if step is not None else self._calls
            for key, o in zip(prompt_keys, outs):
                if o.error is None and o.outputs:
                    self.history.add(key, o.prompt_token_ids, [c.token_ids for c in o.outputs], label)
        return outs

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """Copy new policy weights in place; the KV memory is kept.

        Names are ours (``named_parameters()`` of a :class:`CausalLM`) or Hugging Face's
        (separate ``q/k/v_proj``, ``gate/up_proj``), which are joined first.
        """
        from rhymerl.model import hf_to_ours

        items = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        learnt = {n: t for n, t in items.items() if n.startswith("draft_head.")}
        if learnt:  # weights a draft source learns during RL travel with the policy's
            if self.proposer is None:
                raise KeyError(f"update_weights: {sorted(learnt)[0]!r} needs a draft_head source")
            self.proposer.load_source_state(learnt)
            items = {n: t for n, t in items.items() if n not in learnt}
        items = hf_to_ours(items, self.model.config).items()
        params = dict(self.model.named_parameters())
        if self.model.config.tie_word_embeddings:
            params.setdefault("lm_head.weight", self.model.lm_head.weight)
        for name, t in items:
            if name not in params:
                raise KeyError(f"update_weights: unknown parameter {name!r}")
            p = params[name]
            if p.shape != t.shape:
                raise ValueError(f"update_weights: {name} has shape {tuple(t.shape)}, model has {tuple(p.shape)}")
            p.copy_(t.to(device=p.device, dtype=p.dtype))
