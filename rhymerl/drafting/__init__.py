"""HistoSpec: speculative drafts from each prompt's history (and its live siblings)."""
from __future__ import annotations

from typing import Any

from rhymerl.drafting.drafter import DrafterConfig, HistoryDrafter
from rhymerl.drafting.history import HistoryStore
from rhymerl.drafting.ngram import NgramDrafter
from rhymerl.drafting.suffix_index import SuffixIndex


def build_proposer(spec: dict[str, Any], store: HistoryStore | None = None) -> HistoryDrafter:
    """A proposer from ``{"method": "history" | "ngram", ...DrafterConfig fields}``."""
    spec = dict(spec)
    method = spec.pop("method", "history")
    fields = DrafterConfig.__dataclass_fields__
    unknown = sorted(set(spec) - set(fields) - {"prompt_lookup_min", "prompt_lookup_max"})
    if unknown:
        raise ValueError(f"speculative: unknown keys {unknown} (valid: {sorted(fields)})")
    cfg = DrafterConfig(**{k: v for k, v in spec.items() if k in fields})
    if method == "history":
        return HistoryDrafter(cfg, store)
    if method == "ngram":
        return NgramDrafter(cfg, spec.get("prompt_lookup_min", 3), spec.get("prompt_lookup_max", 7))
    raise ValueError(f"speculative.method {method!r} is not one of 'history', 'ngram'")


__all__ = ["DrafterConfig", "HistoryDrafter", "HistoryStore", "NgramDrafter", "SuffixIndex", "build_proposer"]
