"""Turning matched occurrences into drafts: the most frequent path, or a best-first tree."""
from __future__ import annotations

import heapq

from rhymerl.drafting.suffix_index import Occurrence
from rhymerl.engine.draft import DraftTree


def _children(occ: list[Occurrence], depth: int) -> tuple[dict[int, list[Occurrence]], dict[int, float], float]:
    """Group occurrences by their token ``depth`` steps ahead; a finished sequence that ends
    there keeps its weight in the total (the response stopped), so the ratio reflects it."""
    groups: dict[int, list[Occurrence]] = {}
    weight: dict[int, float] = {}
    total = 0.0
    for o in occ:
        q = o.pos + depth
        if q < len(o.tokens):
            t = o.tokens[q]
            groups.setdefault(t, []).append(o)
            weight[t] = weight.get(t, 0.0) + o.weight
            total += o.weight
        elif o.final:
            total += o.weight
    return groups, weight, total


def draft_path(occ: list[Occurrence], max_len: int, min_prob: float) -> tuple[list[int], list[float]]:
    """Follow the heaviest child while the running probability stays >= ``min_prob``."""
    out: list[int] = []
    probs: list[float] = []
    p = 1.0
    while len(out) < max_len and occ:
        groups, weight, total = _children(occ, len(out))
        if not groups or total <= 0:
            break
        tok = max(weight, key=weight.__getitem__)
        p *= weight[tok] / total
        if p < min_prob:
            break
        out.append(tok)
        probs.append(p)
        occ = groups[tok]
    return out, probs


def draft_tree(occ: list[Occurrence], budget: int, max_depth: int, min_prob: float) -> tuple[DraftTree, list[float]]:
    """Best-first tree: repeatedly add the candidate node of highest estimated probability."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    heap: list[tuple[float, int, int, int, list[Occurrence], int]] = []
    counter = 0

    def push_children(node: int, node_occ: list[Occurrence], depth: int, p: float) -> None:
        nonlocal counter
        if depth >= max_depth:
            return
        groups, weight, total = _children(node_occ, depth)
        if total <= 0:
            return
        for tok, g in groups.items():
            cp = p * weight[tok] / total
            if cp >= min_prob:
                counter += 1
                heapq.heappush(heap, (-cp, counter, node, tok, g, depth + 1))

    push_children(-1, occ, 0, 1.0)
    while heap and len(tokens) < budget:
        negp, _, parent, tok, g, depth = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        probs.append(-negp)
        push_children(len(tokens) - 1, g, depth, -negp)
    return DraftTree(tuple(tokens), tuple(parents)), probs
