"""How much a prompt's new responses repeat its earlier ones: the premise HistoSpec drafts on.

A response token is *covered* when the ``k``-gram ending at it (the token and the ``k - 1``
before it) occurs in one of the prompt's earlier responses: a suffix index over those
responses, matched on the last ``k - 1`` tokens, would have offered it. Machine-independent,
and measured before the new responses join the history.
"""
from __future__ import annotations


def covered_tokens(responses: list[list[int]], earlier: list[list[int]], k: int = 4) -> tuple[int, int]:
    """``(covered, counted)`` over ``responses``: tokens from position ``k - 1`` on (the first
    ``k - 1`` of a response have no full context), and how many of them ``earlier`` covers."""
    grams = {tuple(r[i - k:i]) for r in earlier for i in range(k, len(r) + 1)}
    hit = total = 0
    for r in responses:
        for i in range(k, len(r) + 1):
            total += 1
            hit += tuple(r[i - k:i]) in grams
    return hit, total


def covered_share(responses: list[list[int]], earlier: list[list[int]], k: int = 4) -> float:
    """Share of the counted tokens of ``responses`` that ``earlier`` covers (0 when none counted)."""
    hit, total = covered_tokens(responses, earlier, k)
    return hit / total if total else 0.0
