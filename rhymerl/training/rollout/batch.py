"""A step's batch: its groups generated and scored (:class:`ScoredRollout`), what DAPO's
filter keeps of it (:class:`KeptBatch`), and what the update made of it (:class:`UpdateResult`).
Plain data, JSON-ready where a checkpoint holds it."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rhymerl.data import PromptRow
from rhymerl.engine import RequestOutput
from rhymerl.engine.outputs import CompletionOutput
from rhymerl.training.rollout.partial import CarriedGroup


@dataclass
class GroupScore:
    """One prompt's responses scored."""

    scores: list[float]
    errors: int  # calls that raised (scored 0)
    timeouts: int  # calls that ran past reward.timeout_s (scored 0)
    extras: dict[str, list[float]]
    first_error: str | None


@dataclass
class ScoredRollout:
    """One batch of prompts generated and scored (samples in the order of each output)."""

    rows: list[PromptRow]
    outs: list[RequestOutput]
    scores: list[list[float]]
    errors: int  # reward calls that raised (scored 0)
    timeouts: int  # reward calls past reward.timeout_s (scored 0)
    first_error: str | None
    extras: dict[str, list[float]]  # extra values reward functions returned
    predicted: list[float | None]  # HistoPipe's length prediction per prompt (None: no history)
    gen_s: float  # generation time, the reward time overlapping it excluded
    reward_s: float
    carry: list[CarriedGroup]  # groups paused at the step's token budget (partial rollouts)
    offpolicy_tokens: int  # tokens of ``outs`` drawn under earlier steps' weights
    version: int = 0  # the policy version (updates applied) that drew it
    stats: dict[str, float] = field(default_factory=dict)  # engine and scheduler counters over this rollout
    streamed: Any = None  # the prompt split's update work on these groups (StreamedUpdate), if any
    continued: int = 0  # the leading groups continued from a pause in an earlier step (partial rollouts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (a checkpoint holds the batch an async run had in flight)."""
        return {"keys": [r.key for r in self.rows], "outs": [_out_to_dict(o) for o in self.outs],
                "scores": self.scores, "errors": self.errors, "timeouts": self.timeouts,
                "first_error": self.first_error, "extras": self.extras, "predicted": self.predicted,
                "gen_s": self.gen_s, "reward_s": self.reward_s, "carry": [g.to_dict() for g in self.carry],
                "offpolicy_tokens": self.offpolicy_tokens, "version": self.version, "stats": self.stats,
                "continued": self.continued}

    @classmethod
    def from_dict(cls, d: dict[str, Any], row_of: dict[str, PromptRow]) -> "ScoredRollout":
        """Inverse of :meth:`to_dict`; malformed input raises KeyError, TypeError or ValueError."""
        return cls([row_of[k] for k in d["keys"]], [_out_from_dict(o) for o in d["outs"]],
                   [[float(x) for x in g] for g in d["scores"]], int(d["errors"]), int(d["timeouts"]),
                   d["first_error"], {k: [float(x) for x in v] for k, v in d["extras"].items()},
                   list(d["predicted"]), float(d["gen_s"]), float(d["reward_s"]),
                   [CarriedGroup.from_dict(g) for g in d["carry"]], int(d["offpolicy_tokens"]),
                   int(d["version"]), {k: float(v) for k, v in d["stats"].items()}, continued=int(d.get("continued", 0)))


def _out_to_dict(o: RequestOutput) -> dict[str, Any]:
    return {"request_id": o.request_id, "prompt_token_ids": o.prompt_token_ids, "prompt_key": o.prompt_key,
            "error": o.error, "outputs": [asdict(c) for c in o.outputs]}


def _out_from_dict(d: dict[str, Any]) -> RequestOutput:
    return RequestOutput(int(d["request_id"]), [int(x) for x in d["prompt_token_ids"]],
                         [CompletionOutput(**c) for c in d["outputs"]], d["prompt_key"], d["error"])


@dataclass
class KeptBatch:
    """The groups a step trains on (DAPO's filter applied, refills added) and what the refills
    cost: their rollouts' counters, time and reward failures add to the step's."""

    rows: list[PromptRow]
    outs: list[RequestOutput]
    scores: list[list[float]]
    carry: list[CarriedGroup]  # every paused group, the refills' included
    filtered: int = 0  # groups dropped for equal rewards
    gen_s: float = 0.0
    reward_s: float = 0.0
    errors: int = 0
    timeouts: int = 0
    stats: list[dict[str, float]] = field(default_factory=list)  # the refills' counters

    def flat(self) -> tuple[list[list[int]], list[list[int]], list[list[float]], list[float], list[int]]:
        """Per trained response: prompt ids, response ids, sampling log-probs, score, group index."""
        prompts, responses, behaviour, scores, groups = [], [], [], [], []
        for gi, (o, g) in enumerate(zip(self.outs, self.scores)):
            for c, s in zip(o.outputs, g):
                prompts.append(o.prompt_token_ids)
                responses.append(c.token_ids)
                behaviour.append(c.logprobs or [])
                scores.append(s)
                groups.append(gi)
        return prompts, responses, behaviour, scores, groups


@dataclass
class UpdateResult:
    """What a step's update phases produced: the trained responses' rewards and advantages,
    their seconds (old log-probs, the optimizer's work) and the update's own metrics."""

    rewards: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    advantages: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    old_s: float = 0.0
    update_s: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
