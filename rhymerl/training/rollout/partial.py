"""Partial rollouts: groups paused at a token budget and continued in the next step.

Off by default (``rollout.carry_over_tokens=0``). When on, a sample still unfinished after
that many tokens in a step stops there; its group (finished siblings included) waits and the
next step continues the paused samples from their tokens, with the same seeded draws, under
the new weights. The tokens before the pause came from older weights: those groups are
off-policy, and the loop logs how many such tokens each update saw. Where a sample pauses
depends only on its length, so runs stay reproducible and resumable bit for bit.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rhymerl.engine.outputs import CompletionOutput, RequestOutput


@dataclass
class CarriedGroup:
    """One prompt's group between two steps: finished samples, and paused ones with their prefix."""

    key: str
    seed: int
    since_step: int  # the step whose weights drew its first tokens
    finished: list[CompletionOutput] = field(default_factory=list)
    paused: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)

    def prefix_len(self) -> int:
        """Tokens every paused sample has (they paused together, at the same budget)."""
        return max(len(t) for t, _ in self.paused.values())

    def offpolicy_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.finished) + sum(len(t) for t, _ in self.paused.values())

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "seed": self.seed, "since_step": self.since_step,
                "finished": [asdict(c) for c in self.finished],
                "paused": [[s, t, lp] for s, (t, lp) in sorted(self.paused.items())]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CarriedGroup:
        """Inverse of :meth:`to_dict`; a malformed dict (a damaged checkpoint) raises ValueError."""
        if not isinstance(d, dict) or not isinstance(d.get("key"), str):
            raise ValueError(f"carried group {d!r:.80}: not an object with a string 'key'")
        finished = [CompletionOutput(**c) for c in d["finished"]]
        paused = {int(s): (list(t), list(lp)) for s, t, lp in d["paused"]}
        for c in finished:
            if not (isinstance(c.index, int) and _ints(c.token_ids) and isinstance(c.text, str)):
                raise ValueError(f"carried group {d['key']!r}: malformed finished sample")
        if not all(_ints(t) and all(isinstance(x, (int, float)) for x in lp) for t, lp in paused.values()):
            raise ValueError(f"carried group {d['key']!r}: malformed paused sample")
        return cls(d["key"], int(d["seed"]), int(d["since_step"]), finished, paused)


def _ints(xs: Any) -> bool:
    return isinstance(xs, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)


def step_budget(max_tokens: int, carry_over_tokens: int, prefix_len: int = 0) -> int:
    """``max_tokens`` for this step's request: the budget past what the samples already have."""
    if carry_over_tokens <= 0:
        return max_tokens
    return min(max_tokens, prefix_len + carry_over_tokens)


def paused_samples(out: RequestOutput, limit: int) -> list[CompletionOutput]:
    """Samples stopped by the step's budget, not by a stop token or their real limit ``limit``
    (``max_tokens``, or what ``max_model_len`` leaves after the prompt)."""
    return [c for c in out.outputs if c.finish_reason == "length" and len(c.token_ids) < limit]


def merge(group: CarriedGroup, out: RequestOutput) -> RequestOutput:
    """The whole group: its finished samples from earlier steps and those this step returned."""
    by_index = {c.index: c for c in group.finished}
    by_index.update({c.index: c for c in out.outputs})
    return RequestOutput(request_id=out.request_id, prompt_token_ids=out.prompt_token_ids,
                         outputs=[by_index[i] for i in sorted(by_index)], prompt_key=out.prompt_key,
                         error=out.error)
