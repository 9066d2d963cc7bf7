"""The state of one sample being generated."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from rhymerl.engine.sampler import draw_key
from rhymerl.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(eq=False)
class Sequence:
    """Sample ``sample_index`` of request ``request_id``.

    ``cache_len`` counts tokens whose K/V are in the cache; the last emitted token is not
    yet cached (it is the next step's input), so ``cache_len == num_tokens - 1`` while running.
    """

    request_id: int
    sample_index: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    prompt_key: str | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int = -1
    cache_len: int = 0
    finish_reason: str | None = None
    num_forwards: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    draft_len: int = 0  # current adaptive draft length, owned by the drafter
    stop_ids: frozenset[int] | None = None  # resolved on first use by the engine
    limit: int = 0  # most output tokens allowed (max_tokens and max_model_len)
    group_size: int = 0  # samples of this request in this engine (siblings + itself)
    resumed: bool = False  # started with a generated prefix (moved here from another worker)
    hidden: Any = None  # the target's last hidden state at the last emitted token's position (draft heads)
    draw_key: int = field(init=False)  # hash of (seed, sample_index): the sampler's per-sequence half

    def __post_init__(self) -> None:
        self.draw_key = draw_key(self.seed, self.sample_index)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def prefill_ids(self) -> list[int]:
        """What the prefill computes K/V for: the prompt, plus a resumed prefix but its last
        token (which, like any last token, is the next decode step's input)."""
        return self.prompt_ids + self.output_ids[:-1] if self.resumed else self.prompt_ids

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids
