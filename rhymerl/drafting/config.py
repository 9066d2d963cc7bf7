"""The one speculation config type: the run config's ``rollout.speculative`` section, what a
rollout worker is built from, and what ``LLM(speculative={...})`` takes, field for field."""
from __future__ import annotations

import types
import typing
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Mapping

from rhymerl.field_rules import AT_LEAST_ONE, FRACTION, NON_NEGATIVE, POSITIVE, ZERO_IS_OFF, setting


def checked_fields(cls: type, values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``values`` as keyword arguments of the dataclass ``cls``: an unknown key, or a value not
    of its field's type (a string for a bool, a float for an int), is refused naming
    ``where.key``; an int is taken where a float is wanted."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (valid: {sorted(names)})")
    out = {}
    for key, value in values.items():
        tp = hints[key]
        options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        ok = any(_is(value, t) for t in options)
        if not ok:
            want = " or ".join(getattr(t, "__name__", str(t)) for t in options)
            raise ValueError(f"{where}.{key}: expected {want}, got {value!r}")
        out[key] = float(value) if float in options and isinstance(value, int) and not isinstance(value, bool) \
            else value
    return out


def _is(value: Any, tp: Any) -> bool:
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    origin = typing.get_origin(tp)
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, tp) if isinstance(tp, type) else True


@dataclass
class SpecConfig:
    """How drafts are made and gated. ``method`` names a set of draft sources
    (:data:`rhymerl.drafting.controller.METHODS`); ``sources`` overrides that set."""

    method: str = "history"  # none | history | ngram | draft_model | draft_head | hybrid; vLLM only: suffix | eagle3
    # None: the method's own (registry names of rhymerl.drafting.SOURCES)
    sources: list[str] | None = setting(None, proposer=True)
    # most tokens an index source (history, siblings, ngram) drafts per row
    index_draft_tokens: int = setting(16, range=POSITIVE)
    tree_budget: int = setting(0, range=ZERO_IS_OFF)  # >0: tree drafts with up to this many nodes
    # auto (per engine) | additive (paper) | multiplicative (release) | longest
    length_policy: str = setting("auto", proposer=True)
    min_prob: float = setting(0.1, range=FRACTION, proposer=True)
    pattern_max: int = setting(7, range=POSITIVE, proposer=True)
    pattern_min: int = setting(3, range=AT_LEAST_ONE, proposer=True)
    history_epochs: int = setting(1, range=POSITIVE, proposer=True)
    # >0: branches of higher-reward responses weigh more
    reward_weight: float = setting(0.0, range=NON_NEGATIVE, proposer=True)
    # draft only what pays on this engine (native: the gate; vLLM: each row's draft cut off)
    gate: bool = setting(True, proposer=True)
    prompt_lookup_min: int = setting(3, range=POSITIVE, proposer=True)  # the ngram source's n-gram sizes
    prompt_lookup_max: int = setting(7, range=POSITIVE, proposer=True)
    # Model sources. draft_model: an HF folder (Llama/Qwen2/Qwen3) sharing the target's tokenizer (eagle3: an Eagle3 head's; unset: one trained online).
    draft_model: str | None = None
    # tokens a model source drafts per row (one draft forward each)
    model_draft_tokens: int = setting(4, range=POSITIVE)
    coupled: bool = True  # draft with the target's own per-position uniforms (False: greedy drafts)
    draft_head: str | None = None  # a saved draft head (a folder from rhymerl.drafting.draft_head)
    draft_head_lr: float = setting(1e-3, range=POSITIVE)  # online training of the draft head (or Eagle3 head) during RL

    # Old names still read from config files and dicts (one warning each); removed in a later release.
    RENAMED: ClassVar[dict[str, str]] = {"max_draft": "index_draft_tokens", "draft_max": "model_draft_tokens"}

    @classmethod
    def from_mapping(cls, spec: Mapping[str, Any] | "SpecConfig" | None) -> "SpecConfig":
        """A config from a dict such as ``{"method": "history", "index_draft_tokens": 8}``; unknown
        keys are refused naming the valid ones."""
        if spec is None:
            return cls(method="none")
        if isinstance(spec, SpecConfig):
            return spec
        spec = checked_fields(cls, renamed_keys(spec, "speculative"), "speculative")
        for key in ("index_draft_tokens", "model_draft_tokens"):
            if key in spec and not spec[key] >= 1:
                raise ValueError(f"speculative.{key}: expected an integer >= 1, got {spec[key]!r}")
        return cls(**spec)

    def with_(self, **changes: Any) -> "SpecConfig":
        return SpecConfig(**{**asdict(self), **changes})


def renamed_keys(spec: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``spec`` with :attr:`SpecConfig.RENAMED` keys under their new names (a warning naming
    each); both names at once is refused."""
    out = dict(spec)
    for old, new in SpecConfig.RENAMED.items():
        if old not in out:
            continue
        if new in out:
            raise ValueError(f"{where}: {old} and {new} both set ({old} is {new}'s old name: keep {new})")
        warnings.warn(f"{where}.{old} is now {where}.{new} (the old name is read for now)", FutureWarning,
                      stacklevel=3)
        out[new] = out.pop(old)
    return out


__all__ = ["SpecConfig", "renamed_keys"]
