"""The split of a mini-batch across trainer ranks: every rank the same number of tokens, as
near as whole sequences allow, so no rank waits on another's longer share."""
from __future__ import annotations

import heapq
from typing import Sequence


def balance_by_tokens(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Positions ``0..len(lengths)-1`` split into ``parts`` lists of near-equal token sums.

    Longest first to the lightest part (ties: fewer sequences, then lower rank), as verl's
    ``balance_batch`` evens out the ranks' work; each list is in increasing order. A function
    of ``lengths`` alone, so every rank computes every rank's part without talking.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    heap = [(0, 0, r) for r in range(parts)]
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in order:
        load, count, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + int(lengths[i]), count + 1, r))
    return [sorted(p) for p in out]
