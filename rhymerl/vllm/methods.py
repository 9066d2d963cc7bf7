"""Speculative methods on a vLLM engine, by name: what ``rollout.speculative.method`` means when
``rollout.engine=vllm``. Each maps a :class:`rhymerl.drafting.SpecConfig` to vLLM's
``speculative_config``. Pure data: importing this does not import vLLM."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable

from rhymerl.drafting.config import SpecConfig
from rhymerl.field_rules import marked
from rhymerl.rollout_engines import get_engine, unsupported

PROPOSER = "rhymerl.vllm.HistoSpecProposer"

# SpecConfig fields the HistoSpec proposer reads inside vLLM (marked proposer; sent in
# additional_config). The draft length is not one: it goes out as vLLM's num_speculative_tokens,
# read back from there alone.
_PROPOSER_FIELDS = tuple(marked(SpecConfig, "proposer"))


def _history(c: SpecConfig) -> dict[str, Any]:
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": c.index_draft_tokens}


def _ngram(c: SpecConfig) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": c.index_draft_tokens,
            "prompt_lookup_min": c.prompt_lookup_min, "prompt_lookup_max": c.prompt_lookup_max}


def _suffix(c: SpecConfig) -> dict[str, Any]:  # vLLM's own, backed by arctic-inference
    return {"method": "suffix", "num_speculative_tokens": c.index_draft_tokens}


def _draft_model(c: SpecConfig) -> dict[str, Any]:
    if not c.draft_model:
        raise ValueError("speculative.method=draft_model needs speculative.draft_model=PATH")
    return {"method": "draft_model", "model": c.draft_model, "num_speculative_tokens": c.model_draft_tokens}


def _eagle3(c: SpecConfig) -> dict[str, Any]:  # an Eagle3 head's folder (a run training one online writes it)
    if not c.draft_model:
        raise ValueError("speculative.method=eagle3 needs speculative.draft_model=PATH (an Eagle3 head's folder; "
                         "rhymerl.vllm.eagle3_head.write_head writes a fresh one)")
    return {"method": "eagle3", "model": c.draft_model, "num_speculative_tokens": c.model_draft_tokens}


VLLM_METHODS: dict[str, Callable[[SpecConfig], dict[str, Any]]] = {
    "history": _history,
    "ngram": _ngram,
    "suffix": _suffix,
    "draft_model": _draft_model,
    "eagle3": _eagle3,
}


def get_vllm_method(name: str) -> Callable[[SpecConfig], dict[str, Any]]:
    if name not in VLLM_METHODS:
        raise ValueError(f"speculative.method {name!r} does not run on vLLM; valid there: "
                         f"{['none'] + sorted(VLLM_METHODS)}")
    return VLLM_METHODS[name]


def vllm_speculative(cfg: SpecConfig | None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """vLLM's ``speculative_config`` for ``cfg`` and what the HistoSpec proposer reads from
    ``additional_config["rhymerl"]["speculative"]``; ``(None, {})`` without speculation.
    What vLLM cannot verify is refused here, never dropped."""
    if cfg is None or cfg.method == "none":
        return None, {}
    problems = unsupported(get_engine("vllm"), cfg)
    if problems:
        raise ValueError("; ".join(problems))
    spec = get_vllm_method(cfg.method)(cfg)
    extra = {k: v for k, v in asdict(cfg).items() if k in _PROPOSER_FIELDS} if spec.get("model") == PROPOSER else {}
    return spec, extra
