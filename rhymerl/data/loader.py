"""A seeded, stateful epoch-based prompt loader whose position is part of a checkpoint."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from rhymerl.data.dataset import PromptRow


@dataclass
class LoaderState:
    epoch: int = 0
    index: int = 0  # position within the epoch's permutation
    # Rows of this epoch skipped at the batch that crossed into it (they were already in that
    # batch from the epoch before); served first, so each epoch still serves every row once.
    deferred: list[int] = field(default_factory=list)


class PromptLoader:
    """Yields batches of prompts; each epoch is a fresh permutation drawn from (seed, epoch).

    A batch never holds one prompt twice: a batch that straddles an epoch boundary takes the
    new epoch's rows that are not already in it, and defers the others to the next batch
    (the same prompt twice in a batch would be the same group, same seed, twice).
    """

    def __init__(self, rows: list[PromptRow], batch_size: int, seed: int) -> None:
        if batch_size > len(rows):
            raise ValueError(f"batch of {batch_size} prompts but the dataset has only {len(rows)}")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.state = LoaderState()
        self._perm_cache: tuple[int, list[int]] = (-1, [])

    def _perm(self, epoch: int) -> list[int]:
        if self._perm_cache[0] != epoch:
            perm = random.Random(self.seed * 1_000_003 + epoch).sample(range(len(self.rows)), len(self.rows))
            self._perm_cache = (epoch, perm)
        return self._perm_cache[1]

    def next_batch(self, size: int | None = None) -> list[PromptRow]:
        """The next ``size`` distinct prompts, continuing into the next epoch when this one runs out."""
        size = min(size or self.batch_size, len(self.rows))
        taken: list[int] = []
        chosen: set[int] = set()
        while len(taken) < size:
            st = self.state
            j = next((j for j, i in enumerate(st.deferred) if i not in chosen), None)
            if j is not None:
                i = st.deferred.pop(j)
            elif st.index < len(self.rows):
                i = self._perm(st.epoch)[st.index]
                st.index += 1
                if i in chosen:
                    st.deferred.append(i)
                    continue
            else:
                # (Deferred rows still here only when an epoch is shorter than two batches:
                # they stay deferred, into the next epoch.)
                self.state = LoaderState(st.epoch + 1, 0, st.deferred)
                continue
            taken.append(i)
            chosen.add(i)
        return [self.rows[i] for i in taken]

    def state_dict(self) -> dict:
        return {"epoch": self.state.epoch, "index": self.state.index, "deferred": list(self.state.deferred)}

    def load_state_dict(self, d: dict) -> None:
        """Restore a position; one that does not fit this dataset raises ValueError."""
        epoch, index, deferred = d["epoch"], d["index"], d.get("deferred", [])
        n = len(self.rows)
        if not (_int(epoch) and epoch >= 0 and _int(index) and 0 <= index <= n and isinstance(deferred, list)
                and all(_int(i) and 0 <= i < n for i in deferred)):
            raise ValueError(f"loader state {d!r:.120} does not fit a dataset of {n} rows")
        self.state = LoaderState(epoch, index, list(deferred))


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
