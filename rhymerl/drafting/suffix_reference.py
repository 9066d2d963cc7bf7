"""The suffix index and drafting from its matches, in plain Python: the reference for the
compiled core (``_suffix_core.cpp``, the same algorithm and API), which the tests hold equal
to it, and the fallback where the core was not built.

Every position where a 3-gram ends is listed under that 3-gram. A query takes the last
``max_match`` tokens of a context, finds the occurrences of its last 3 tokens, extends
each match backwards, and keeps the occurrences of the *longest* matching suffix: exactly
the node a suffix tree reaches with back-off from ``max_match`` down to 3 tokens. The
tokens that follow those occurrences, counted, are that node's children and their counts.
Adding a sequence costs O(length) (no rebuild), so a new epoch's responses and the tokens
that live siblings emit each step go in at once.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence as Seq

import numpy as np

MIN_MATCH = 3
MAX_OCCURRENCES = 64  # per query, most recent first: bounds work on repetitive text
VOCAB_LIMIT = 1 << 21  # three ids pack into one key


def _key(a: int, b: int, c: int) -> int:
    return (a * VOCAB_LIMIT + b) * VOCAB_LIMIT + c


def _checked(tokens: Seq[int]) -> list[int]:
    out = list(tokens)
    for t in out:
        if not 0 <= t < VOCAB_LIMIT:
            raise ValueError(f"token id {t} is outside [0, 2**21): the suffix index packs three ids per key")
    return out


def _tail(output: Seq[int], prompt: Seq[int], n: int) -> list[int]:
    """The last ``n`` tokens of prompt + output (reaching into the prompt early in a response)."""
    if len(output) >= n:
        return list(output[len(output) - n:])
    return list(prompt[max(0, len(prompt) - (n - len(output))):]) + list(output)


class SuffixIndex:
    def __init__(self) -> None:
        self._seqs: list[list[int]] = []
        self._weights: list[float] = []
        self._final: list[bool] = []  # the sequence really ended (a finished response)
        self._grams: dict[int, list[tuple[int, int]]] = {}
        self._followed: list[tuple[int, list[int], int]] = []  # live sequences mirrored from lists
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, tokens: Seq[int], weight: float = 1.0, final: bool = True) -> int:
        """Index a sequence (a copy); returns its id."""
        sid = len(self._seqs)
        self._seqs.append(_checked(tokens))
        self._weights.append(weight)
        self._final.append(final)
        self.num_tokens += len(self._seqs[sid])
        self._index_from(sid, 0)
        return sid

    def append(self, sid: int, tokens: Seq[int], start: int = 0) -> None:
        """Append ``tokens[start:]`` to sequence ``sid`` and index the grams they complete."""
        seq = self._seqs[sid]
        before = len(seq)
        seq += _checked(tokens[start:])
        self.num_tokens += len(seq) - before
        self._index_from(sid, before)

    def follow(self, sid: int, source: list[int], offset: int) -> None:
        """Let sequence ``sid`` mirror the list ``source`` (grown in place elsewhere) after
        ``offset`` tokens of its own; :meth:`sync` appends what it has grown by."""
        if not 0 <= offset <= len(self._seqs[sid]):
            raise ValueError("follow: the offset is outside the sequence")
        self._followed.append((sid, source, offset))

    def sync(self) -> None:
        """Append to every followed sequence what its source has grown by (one call per step)."""
        for sid, src, off in self._followed:
            have = len(self._seqs[sid]) - off
            if have < len(src):
                self.append(sid, src, have)

    @staticmethod
    def sync_all(indices: list["SuffixIndex"]) -> None:
        """:meth:`sync` of every index in one call (a decode step's live indices)."""
        for idx in indices:
            idx.sync()

    def size(self, sid: int) -> int:
        return len(self._seqs[sid])

    def tokens(self, sid: int) -> list[int]:
        return list(self._seqs[sid])

    def _index_from(self, sid: int, start: int) -> None:
        seq, grams = self._seqs[sid], self._grams
        for end in range(max(start + 1, MIN_MATCH), len(seq) + 1):
            grams.setdefault(_key(seq[end - 3], seq[end - 2], seq[end - 1]), []).append((sid, end))

    def match(self, context: Seq[int], max_match: int, min_match: int = MIN_MATCH) -> "Matches | None":
        """Matches of the longest suffix of ``context`` (``min_match..max_match`` tokens), or None.

        Occurrences at the growing end of a live sequence (no next token yet) are left out."""
        ctx = list(context)
        n = len(ctx)
        if n < MIN_MATCH:
            return None
        hits = self._grams.get(_key(ctx[-3], ctx[-2], ctx[-1]))
        if not hits:
            return None
        best, found = 0, []
        for sid, end in hits[-MAX_OCCURRENCES:]:
            seq = self._seqs[sid]
            if end >= len(seq) and not self._final[sid]:
                continue
            m = 3
            while m < max_match and m < n and end - m - 1 >= 0 and seq[end - m - 1] == ctx[n - m - 1]:
                m += 1
            if m > best:
                best, found = m, [(self, sid, end)]
            elif m == best:
                found.append((self, sid, end))
        if best < max(min_match, MIN_MATCH) or not found:
            return None
        return Matches(best, found)


class Matches:
    """A row's matched occurrences (possibly pooled from several indices)."""

    def __init__(self, match: int, occ: list[tuple[SuffixIndex, int, int]]) -> None:
        self.match = match
        self._occ = occ

    def __len__(self) -> int:
        return len(self._occ)

    def __bool__(self) -> bool:
        return bool(self._occ)

    def __add__(self, other: "Matches") -> "Matches":
        """Pool another source's occurrences (this one's match length)."""
        return Matches(self.match, self._occ + other._occ)

    def next_tokens(self) -> list[int]:
        """Per occurrence, the token that follows it (-1 where its sequence ended)."""
        return [idx._seqs[s][p] if p < len(idx._seqs[s]) else -1 for idx, s, p in self._occ]

    def most_recent(self) -> "Matches":
        """The occurrence latest in its sequence alone (the first of equals)."""
        return Matches(self.match, [max(self._occ, key=lambda o: o[2])] if self._occ else [])

    @staticmethod
    def of_tokens(continuations: list[Seq[int]], match: int = MIN_MATCH, weight: float = 1.0) -> "Matches":
        """Matches whose continuations are the given token lists (for sources that pick their own)."""
        idx = SuffixIndex()
        return Matches(match, [(idx, idx.add(c, weight, True), 0) for c in continuations])


def match_batch(indices: list[SuffixIndex | None], outputs: list[Seq[int]], prompts: list[Seq[int]],
                max_match: int, min_match: int = MIN_MATCH) -> list[Matches | None]:
    """Per row, the matches of the last ``max_match`` tokens of prompt + output in that row's
    index (None: no index, or no match)."""
    if not len(indices) == len(outputs) == len(prompts):
        raise ValueError("match_batch: indices, outputs and prompts differ in length")
    return [None if idx is None else idx.match(_tail(o, p, max_match), max_match, min_match)
            for idx, o, p in zip(indices, outputs, prompts)]


def _children(occ: list[tuple[SuffixIndex, int, int]], depth: int):
    """Group occurrences by their token ``depth`` steps ahead; a finished sequence that ends
    there keeps its weight in the total (the response stopped), so the ratio reflects it."""
    groups: dict[int, list] = {}
    weight: dict[int, float] = {}
    total = 0.0
    for o in occ:
        idx, sid, pos = o
        seq, w = idx._seqs[sid], idx._weights[sid]
        q = pos + depth
        if q < len(seq):
            t = seq[q]
            groups.setdefault(t, []).append(o)
            weight[t] = weight.get(t, 0.0) + w
            total += w
        elif idx._final[sid]:
            total += w
    return groups, weight, total


def draft_path(m: Matches, max_len: int, min_prob: float) -> tuple[list[int], list[float]]:
    """Follow the heaviest child while the running probability stays >= ``min_prob``."""
    out, probs, _ = _draft_path(m, max_len, min_prob)
    return out, probs


def _draft_path(m: Matches, max_len: int, min_prob: float) -> tuple[list[int], list[float], list[float]]:
    """:func:`draft_path` and each token's support: the weight of the continuations seen at its
    context (one occurrence left: its weight)."""
    out: list[int] = []
    probs: list[float] = []
    support: list[float] = []
    p = 1.0
    occ = m._occ
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
        support.append(total)
        occ = groups[tok]
    return out, probs, support


def draft_tree(m: Matches, budget: int, max_depth: int, min_prob: float) -> tuple[list[int], list[int], list[float]]:
    """Best-first tree: repeatedly add the candidate node of highest estimated probability."""
    return _draft_tree(m, budget, max_depth, min_prob)[:3]


def _draft_tree(m: Matches, budget: int, max_depth: int,
                min_prob: float) -> tuple[list[int], list[int], list[float], list[float]]:
    """:func:`draft_tree` and each node's support (as :func:`_draft_path`'s)."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    support: list[float] = []
    heap: list = []
    counter = 0

    def push_children(node: int, node_occ: list, depth: int, p: float) -> None:
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
                heapq.heappush(heap, (-cp, counter, node, tok, g, depth + 1, total))

    push_children(-1, m._occ, 0, 1.0)
    while heap and len(tokens) < budget:
        negp, _, parent, tok, g, depth, total = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        probs.append(-negp)
        support.append(total)
        push_children(len(tokens) - 1, g, depth, -negp)
    return tokens, parents, probs, support


def draft_paths(matches: list[Matches], caps: list[int], min_prob: float) -> list[tuple[list[int], list[float]]]:
    """Per row, (tokens, probabilities) of the heaviest path, at most ``caps[i]`` long."""
    if len(matches) != len(caps):
        raise ValueError("draft_paths: matches and caps differ in length")
    return [draft_path(m, c, min_prob) for m, c in zip(matches, caps)]


def draft_trees(matches: list[Matches], budgets: list[int], caps: list[int],
                min_prob: float) -> list[tuple[list[int], list[int], list[float]]]:
    """Per row, (tokens, parents, probabilities) of a best-first tree of ``budgets[i]`` nodes,
    ``caps[i]`` deep."""
    if not len(matches) == len(budgets) == len(caps):
        raise ValueError("draft_trees: matches, budgets and caps differ in length")
    return [draft_tree(m, b, c, min_prob) for m, b, c in zip(matches, budgets, caps)]


def longest_match_drafts(per_source: list[list], merge: list[bool], fallback: list[bool], outputs: list[Seq[int]],
                         prompts: list[Seq[int]], caps: list[int], pattern_max: int, pattern_min: int,
                         min_prob: float, tree_budget: int, with_probs: bool = True) -> tuple:
    """The controller's longest-match rule over occurrence sources, and the drafts, for a batch.

    ``per_source[k][i]`` is the index source ``k`` matches row ``i``'s context in, or the
    :class:`Matches` it found itself, or None; rows with ``caps[i] <= 0`` are not drafted.
    Each source in order: a longer match wins, an equal one of two merging sources pools its
    occurrences, a fallback source is asked only while the best match is shorter than
    ``pattern_max``. Returns numpy arrays ``(source [R] (-1: no draft), lengths [R], tokens,
    parents, depths [R, W], node probabilities [R, W] and supports [R, W] (the weight of the
    continuations seen at each node's context), both None without with_probs)``, ``W`` the
    longest draft; past a row's length: token -1, parent -1, depth 0, probability and support 0."""
    rows = len(caps)
    if not len(outputs) == len(prompts) == rows or not len(merge) == len(fallback) == len(per_source):
        raise ValueError("longest_match_drafts: arguments differ in length")
    if any(len(col) != rows for col in per_source):
        raise ValueError("longest_match_drafts: a source's list is not one per row")
    found: list[tuple[int, list[int], list[int], list[float], list[float]] | None] = []
    for i in range(rows):
        best, winner = None, -1
        for k, col in enumerate(per_source):
            if caps[i] <= 0:
                break
            if fallback[k] and best is not None and best.match >= pattern_max:
                continue
            h = col[i]
            if isinstance(h, SuffixIndex):
                h = h.match(_tail(outputs[i], prompts[i], pattern_max), pattern_max, pattern_min)
            if not h:
                continue
            if best is None or h.match > best.match:
                best, winner = h, k
            elif h.match == best.match and merge[k] and merge[winner]:
                best = best + h
        if best is None:
            found.append(None)
            continue
        if tree_budget > 0:
            toks, parents, probs, support = _draft_tree(best, min(tree_budget, max(caps[i], 1) * 2), caps[i], min_prob)
        else:
            toks, probs, support = _draft_path(best, caps[i], min_prob)
            parents = list(range(-1, len(toks) - 1))
        found.append((winner, toks, parents, probs, support) if toks else None)
    W = max((len(f[1]) for f in found if f is not None), default=0)
    src = np.full(rows, -1, dtype=np.int64)
    lengths = np.zeros(rows, dtype=np.int64)
    tokens = np.full((rows, W), -1, dtype=np.int64)
    par = np.full((rows, W), -1, dtype=np.int64)
    dep = np.zeros((rows, W), dtype=np.int64)
    pr = np.zeros((rows, W if with_probs else 0))
    su = np.zeros_like(pr)
    for i, f in enumerate(found):
        if f is None:
            continue
        k, toks, parents, probs, support = f
        n = len(toks)
        src[i], lengths[i] = k, n
        tokens[i, :n], par[i, :n] = toks, parents
        for j, p in enumerate(parents):
            dep[i, j] = 1 if p < 0 else dep[i, p] + 1
        if with_probs:
            pr[i, :n], su[i, :n] = probs, support
    if not with_probs:
        pr = su = None
    return src, lengths, tokens, par, dep, pr, su
