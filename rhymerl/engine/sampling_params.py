"""Per-request sampling settings, vLLM-style."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to sample one prompt's ``n`` responses.

    ``seed`` fixes every random draw of the request: the draw for sample ``i`` at output
    position ``j`` is a pure function of ``(seed, i, j)``, so the output does not depend on
    the batch, on other requests, or on whether speculative decoding is on. With
    ``seed=None`` the engine draws a seed from its own generator.
    ``temperature=0`` is greedy. ``logprobs=True`` returns the log-probability of each
    emitted token under the sampling distribution (after temperature, top-k, top-p).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
