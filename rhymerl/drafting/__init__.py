"""Drafting: draft sources (history, siblings, n-grams, a draft model, a draft head) under one
controller that gates, sizes and picks drafts per request (:mod:`.controller`)."""
from __future__ import annotations

from typing import Any, Mapping

from rhymerl.drafting.config import SpecConfig
from rhymerl.drafting.controller import METHODS, SpecController, get_method
from rhymerl.drafting.history import HistoryStore
from rhymerl.drafting.source import SOURCES, Candidate, DraftSource, SourceContext, get_source, register_source
from rhymerl.drafting.suffix_index import SuffixIndex

# Importing the built-in sources registers them.
from rhymerl.drafting import draft_head, draft_model, history_sources, ngram, siblings  # noqa: E402

def build_proposer(spec: SpecConfig | Mapping[str, Any], store: HistoryStore | None = None, *,
                   target=None, target_path: str | None = None) -> SpecController:
    """The engine's proposer for a speculation config (a :class:`SpecConfig` or its dict).

    ``store`` is read, never written: whoever generates the history records it. ``target`` is
    the model being drafted for (model sources share its embeddings, device and dtype)."""
    cfg = SpecConfig.from_mapping(spec)
    if store is None:
        store = HistoryStore(max_rollouts=max(1, cfg.history_epochs))
    return SpecController(cfg, store, target=target, target_path=target_path)


def source_names(cfg: SpecConfig) -> tuple[str, ...]:
    """The draft sources a config uses: none for ``method: none`` and for a method another engine
    drafts with itself (vLLM's ``suffix``, ``eagle3``: the config check names where each runs)."""
    if cfg.method == "none" or (cfg.sources is None and cfg.method not in METHODS):
        return ()
    return tuple(cfg.sources) if cfg.sources is not None else get_method(cfg.method)(cfg).sources


def uses_history(cfg: SpecConfig) -> bool:
    """Whether a config's sources read the history store (each source class says)."""
    return any(get_source(n).reads_history for n in source_names(cfg))


def trains_draft_head(cfg: SpecConfig) -> bool:
    """Whether drafts come (partly) from a draft head trained online (none loaded from a folder)."""
    return cfg.draft_head is None and "draft_head" in source_names(cfg)


def trains_eagle3(cfg: SpecConfig) -> bool:
    """Whether vLLM drafts with an Eagle3 head trained online (none loaded from ``draft_model``)."""
    return cfg.method == "eagle3" and cfg.draft_model is None


__all__ = ["draft_head", "draft_model", "history_sources", "ngram", "siblings", "Candidate", "DraftSource", "HistoryStore", "METHODS", "SOURCES", "SourceContext", "SpecConfig",
           "SpecController", "SuffixIndex", "build_proposer", "get_method", "get_source", "register_source",
           "source_names", "trains_draft_head", "trains_eagle3", "uses_history"]
