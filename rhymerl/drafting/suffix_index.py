"""An occurrence index over token sequences, queried like a suffix tree.

Every position where a 3-gram ends is listed under that 3-gram. A query takes the last
``max_match`` tokens of a context, finds the occurrences of its last 3 tokens, extends
each match backwards, and keeps the occurrences of the *longest* matching suffix: exactly
the node a suffix tree reaches with back-off from ``max_match`` down to 3 tokens. The
tokens that follow those occurrences, counted, are that node's children and their counts.
Adding a sequence costs O(length) (no rebuild), so a new epoch's responses and the tokens
that live siblings emit each step go in at once.
"""
from __future__ import annotations

from dataclasses import dataclass

_P = 1 << 21  # vocabularies up to 2M tokens; 3 tokens pack into one int


def _key(a: int, b: int, c: int) -> int:
    return (a * _P + b) * _P + c


@dataclass
class Occurrence:
    """Position ``pos`` in ``tokens`` is the first token after a match."""

    tokens: list[int]
    pos: int
    weight: float
    final: bool  # the sequence really ended at len(tokens) (a finished response)


class SuffixIndex:
    MIN_MATCH = 3
    MAX_OCCURRENCES = 64  # per query, most recent first: bounds work on repetitive text

    def __init__(self) -> None:
        self.seqs: list[list[int]] = []
        self.weights: list[float] = []
        self.final: list[bool] = []
        self._indexed: list[int] = []  # how many tokens of each sequence are indexed
        self.grams: dict[int, list[tuple[int, int]]] = {}

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, tokens: list[int], weight: float = 1.0, final: bool = True) -> int:
        """Index a sequence (the list is kept by reference; ``extend`` indexes what it grows by)."""
        sid = len(self.seqs)
        self.seqs.append(tokens)
        self.weights.append(weight)
        self.final.append(final)
        self._indexed.append(0)
        self.extend(sid)
        return sid

    def extend(self, sid: int) -> None:
        """Index the grams completed by tokens appended to sequence ``sid`` since the last call."""
        seq, start = self.seqs[sid], self._indexed[sid]
        grams = self.grams
        for end in range(max(start + 1, self.MIN_MATCH), len(seq) + 1):
            grams.setdefault(_key(seq[end - 3], seq[end - 2], seq[end - 1]), []).append((sid, end))
        self._indexed[sid] = len(seq)

    def match(self, context: list[int], max_match: int, min_match: int = 3) -> tuple[list[Occurrence], int]:
        """Occurrences of the longest suffix of ``context`` (``min_match..max_match`` tokens) found here.

        Occurrences at the growing end of a live sequence (no next token yet) are left out.
        """
        n = len(context)
        if n < self.MIN_MATCH:
            return [], 0
        hits = self.grams.get(_key(context[-3], context[-2], context[-1]))
        if not hits:
            return [], 0
        best, found = 0, []
        for sid, end in hits[-self.MAX_OCCURRENCES:]:
            seq = self.seqs[sid]
            if end >= len(seq) and not self.final[sid]:
                continue
            m = 3
            while m < max_match and m < n and end - m - 1 >= 0 and seq[end - m - 1] == context[n - m - 1]:
                m += 1
            if m > best:
                best, found = m, [(sid, end)]
            elif m == best:
                found.append((sid, end))
        if best < max(min_match, self.MIN_MATCH):
            return [], 0
        return [Occurrence(self.seqs[s], e, self.weights[s], self.final[s]) for s, e in found], best
