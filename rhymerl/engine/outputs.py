"""What ``LLM.generate`` returns, in vLLM's shape."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One sampled response."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | None while running
    logprobs: list[float] | None = None
    num_forwards: int = 0  # target forward passes this response took part in
    num_drafted: int = 0
    num_accepted: int = 0
    # time.perf_counter() in the engine's process when the sample finished, as vLLM's request
    # metrics keep it: what a rollout's tail is measured from (not part of a sample's identity)
    finished_at: float | None = field(default=None, compare=False)


@dataclass
class RequestOutput:
    """All ``n`` responses to one prompt. ``error`` is set (and ``outputs`` empty) for a request
    that could not run, such as a prompt longer than ``max_model_len``."""

    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_key: str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or all(o.finish_reason is not None for o in self.outputs)
