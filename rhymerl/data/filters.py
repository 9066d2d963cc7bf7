"""Rows checked against the run's tokenizer and context before training starts.

A prompt that leaves too little room to answer, or that the tokenizer cannot encode, would
otherwise end the run when its batch comes up (and every resume after it). Overlong rows
are dropped (verl's ``filter_overlong_prompts``); unencodable rows are an error naming the
file, row and characters, or are dropped with ``data.skip_bad_rows``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from rhymerl.data.dataset import DatasetError, PromptRow
from rhymerl.tokenizer import encode_prompt

log = logging.getLogger(__name__)


@dataclass
class FilterReport:
    """What :func:`filter_rows` dropped (row origins), for the log and the metrics."""

    overlong: list[str] = field(default_factory=list)
    unencodable: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = []
        if self.overlong:
            parts.append(f"{len(self.overlong)} overlong ({_some(self.overlong)})")
        if self.unencodable:
            parts.append(f"{len(self.unencodable)} unencodable ({_some(self.unencodable)})")
        return "; ".join(parts)


def _some(origins: list[str], k: int = 8) -> str:
    return ", ".join(origins[:k]) + (f", ... {len(origins) - k} more" if len(origins) > k else "")


def _texts(prompt: str | list[dict[str, Any]]) -> list[str]:
    return [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]


def unencodable_chars(tokenizer: Any, prompt: str | list[dict[str, Any]]) -> list[str]:
    """The characters of ``prompt`` that the tokenizer cannot encode on their own."""
    bad = []
    for ch in sorted({c for t in _texts(prompt) for c in t}):
        try:
            tokenizer.encode(ch, add_special_tokens=False)
        except Exception:  # noqa: BLE001 - tokenizers raise their own exception types
            bad.append(ch)
    return bad


def filter_rows(rows: list[PromptRow], tokenizer: Any, *, max_model_len: int, min_response_tokens: int,
                skip_bad_rows: bool = False, what: str = "train") -> tuple[list[PromptRow], FilterReport]:
    """The rows that fit, and what was dropped. Raises :class:`DatasetError` for an
    unencodable row unless ``skip_bad_rows``."""
    kept: list[PromptRow] = []
    report = FilterReport()
    limit = max_model_len - min_response_tokens
    for r in rows:
        try:
            n = len(encode_prompt(tokenizer, r.prompt))
        except Exception as e:  # noqa: BLE001 - tokenizers raise their own exception types
            chars = unencodable_chars(tokenizer, r.prompt)
            detail = (f"characters outside the tokenizer's vocabulary: {''.join(chars)!r}" if chars
                      else f"{type(e).__name__}: {e}")
            if not skip_bad_rows:
                raise DatasetError(f"{r.origin or 'key ' + r.key}: prompt cannot be tokenized ({detail}); "
                                   "fix the row, or set data.skip_bad_rows=true to drop such rows") from e
            report.unencodable.append(r.origin or r.key)
            continue
        if n > limit:
            report.overlong.append(r.origin or r.key)
            continue
        kept.append(r)
    if report.overlong or report.unencodable:
        log.warning("%s data: dropped %s (prompts must leave data.min_response_tokens=%d of "
                    "rollout.max_model_len=%d)", what, report.summary(), min_response_tokens, max_model_len)
    if rows and not kept:
        raise DatasetError(f"{what} data: every one of {len(rows)} rows was dropped ({report.summary()})")
    return kept, report
