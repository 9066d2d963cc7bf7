"""The one speculation config type: the run config's ``rollout.speculative`` section, what a
rollout worker is built from, and what ``LLM(speculative={...})`` takes, field for field."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping


@dataclass
class SpecConfig:
    """How drafts are made and gated. ``method`` names a set of draft sources
    (:data:`rhymerl.drafting.controller.METHODS`); ``sources`` overrides that set."""

    method: str = "history"  # none | history | ngram | draft_model | draft_head | hybrid; vLLM only: suffix | eagle3
    sources: list[str] | None = None  # None: the method's own (registry names of rhymerl.drafting.SOURCES)
    max_draft: int = 16
    tree_budget: int = 0  # >0: tree drafts with up to this many nodes
    length_policy: str = "auto"  # auto (per engine) | additive (paper) | multiplicative (release) | longest
    min_prob: float = 0.1
    pattern_max: int = 7
    pattern_min: int = 3
    history_epochs: int = 1
    reward_weight: float = 0.0  # >0: branches of higher-reward responses weigh more
    gate: bool = True
    prompt_lookup_min: int = 3  # the ngram source's n-gram sizes
    prompt_lookup_max: int = 7
    # Model sources. draft_model: an HF folder (Llama/Qwen2/Qwen3) sharing the target's tokenizer (eagle3: an Eagle3 head's; unset: one trained online).
    draft_model: str | None = None
    draft_max: int = 4  # tokens a model source drafts per row (one draft forward each)
    coupled: bool = True  # draft with the target's own per-position uniforms (False: greedy drafts)
    draft_head: str | None = None  # a saved draft head (a folder from rhymerl.drafting.draft_head)
    draft_head_lr: float = 1e-3  # online training of the draft head (or Eagle3 head) during RL

    @classmethod
    def from_mapping(cls, spec: Mapping[str, Any] | "SpecConfig" | None) -> "SpecConfig":
        """A config from a dict such as ``{"method": "history", "max_draft": 8}``; unknown keys
        are refused naming the valid ones."""
        if spec is None:
            return cls(method="none")
        if isinstance(spec, SpecConfig):
            return spec
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - names)
        if unknown:
            raise ValueError(f"speculative: unknown keys {unknown} (valid: {sorted(names)})")
        return cls(**dict(spec))

    def with_(self, **changes: Any) -> "SpecConfig":
        return SpecConfig(**{**asdict(self), **changes})


__all__ = ["SpecConfig"]
