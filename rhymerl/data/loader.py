"""A seeded, stateful epoch-based prompt loader whose position is part of a checkpoint."""
from __future__ import annotations

import random
from dataclasses import dataclass

from rhymerl.data.dataset import PromptRow


@dataclass
class LoaderState:
    epoch: int = 0
    index: int = 0  # position within the epoch's permutation


class PromptLoader:
    """Yields batches of prompts; each epoch is a fresh permutation drawn from (seed, epoch)."""

    def __init__(self, rows: list[PromptRow], batch_size: int, seed: int) -> None:
        if batch_size > len(rows):
            raise ValueError(f"batch of {batch_size} prompts but the dataset has only {len(rows)}")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.state = LoaderState()

    def _perm(self, epoch: int) -> list[int]:
        return random.Random(self.seed * 1_000_003 + epoch).sample(range(len(self.rows)), len(self.rows))

    def next_batch(self, size: int | None = None) -> list[PromptRow]:
        """The next ``size`` prompts, continuing into the next epoch when this one runs out."""
        size = size or self.batch_size
        out: list[PromptRow] = []
        while len(out) < size:
            perm = self._perm(self.state.epoch)
            take = perm[self.state.index: self.state.index + size - len(out)]
            out += [self.rows[i] for i in take]
            self.state.index += len(take)
            if self.state.index >= len(perm):
                self.state = LoaderState(self.state.epoch + 1, 0)
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.state.epoch, "index": self.state.index}

    def load_state_dict(self, d: dict) -> None:
        self.state = LoaderState(int(d["epoch"]), int(d["index"]))
