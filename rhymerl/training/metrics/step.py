"""A step's metrics as pure functions of what the step produced (verl's ``metric_utils``).

The loop gathers the facts (a :class:`StepFacts`); each function here turns one part of them
into named metrics. Names follow verl where it has one (``critic/score/mean``,
``response_length/*``, ``timing_s/*``, ``perf/*``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rhymerl.engine.llm_engine import accepted_per_forward
from rhymerl.engine.outputs import RequestOutput


@dataclass
class StepTimes:
    """Seconds of one step's phases (generation excludes the reward time that overlapped it)."""

    gen: float = 0.0
    reward: float = 0.0
    old_logp: float = 0.0
    update: float = 0.0
    sync: float = 0.0
    step: float = 0.0
    wait_rollout: float | None = None  # async RL: the rollout time the step still waited for


@dataclass
class StepFacts:
    """What one step produced, for the metric functions."""

    scores: list[list[float]]  # every scored group's rewards (filtered groups included)
    outs: list[RequestOutput]  # every scored group's outputs
    rewards: torch.Tensor  # the trained responses' (shaped) rewards
    advantages: torch.Tensor  # ... and advantages
    errors: int  # reward calls that raised
    timeouts: int  # reward calls that ran past reward.timeout_s
    filtered: int  # groups DAPO's filter dropped
    carried: int  # groups paused at the token budget, waiting for the next step
    offpolicy_tokens: int  # trained tokens drawn under earlier steps' weights
    epoch: int  # the trained batch's epoch of the prompt set
    counts: dict[str, float]  # engine, drafter and scheduler counters over the step's rollouts
    extras: dict[str, list[float]] = field(default_factory=dict)  # extra values reward functions returned
    predicted: list[float | None] = field(default_factory=list)  # HistoPipe's length prediction per group
    sync_bytes: int = 0
    workers: int = 1


def reward_metrics(f: StepFacts) -> dict[str, Any]:
    all_scores = [s for g in f.scores for s in g] or [0.0]  # a step whose every group paused trains on nothing
    trained = f.rewards.numel() > 0
    out = {"critic/score/mean": float(np.mean(all_scores)),
           "critic/score/max": float(np.max(all_scores)),
           "critic/rewards/mean": float(f.rewards.mean()) if trained else 0.0,
           "critic/advantages/abs_mean": float(f.advantages.abs().mean()) if trained else 0.0,
           "reward/errors": f.errors,
           "reward/timeouts": f.timeouts}
    out.update({f"reward_extra/{k}": float(np.mean(v)) for k, v in f.extras.items()})
    return out


def response_metrics(f: StepFacts) -> dict[str, Any]:
    lengths = [len(c.token_ids) for o in f.outs for c in o.outputs] or [0]
    return {"response_length/mean": float(np.mean(lengths)),
            "response_length/max": int(np.max(lengths)),
            "response_length/min": int(np.min(lengths)),
            "response_length/clip_ratio": float(np.mean([c.finish_reason == "length" for o in f.outs
                                                         for c in o.outputs] or [0.0]))}


def data_metrics(f: StepFacts) -> dict[str, Any]:
    tokens = sum(len(c.token_ids) for o in f.outs for c in o.outputs) or 0
    return {"data/filtered_groups": f.filtered,
            "rollout/carried_groups": f.carried,
            "rollout/offpolicy_tokens": f.offpolicy_tokens,
            "rollout/offpolicy_fraction": f.offpolicy_tokens / max(1, tokens),
            "data/epoch": f.epoch}


def timing_metrics(f: StepFacts, t: StepTimes) -> dict[str, Any]:
    gen_tokens = f.counts.get("generated", 0.0)
    out = {"timing_s/gen": t.gen, "timing_s/reward": t.reward, "timing_s/old_logp": t.old_logp,
           "timing_s/update": t.update, "timing_s/sync": t.sync, "timing_s/step": t.step,
           "perf/sync_bytes": f.sync_bytes,
           "perf/throughput": gen_tokens / t.step,
           "perf/gen_tokens_per_s": gen_tokens / max(t.gen, 1e-9)}
    if t.wait_rollout is not None:
        out["timing_s/wait_rollout"] = t.wait_rollout
    return out


def speculation_metrics(f: StepFacts) -> dict[str, Any]:
    """Machine-independent counts of the step's decoding: tokens per sequence per forward,
    acceptance, and per draft source the tokens it had accepted."""
    c = f.counts
    rows, acc, drafted = c.get("decode_rows", 0.0), c.get("accepted", 0.0), c.get("drafted", 0.0)
    samples = sum(len(o.outputs) for o in f.outs)
    out = {"spec/accepted_per_forward": accepted_per_forward(rows, acc),
           "spec/forwards_per_token": rows / max(1, c.get("generated", 0.0) - samples),
           "spec/acceptance_rate": acc / drafted if drafted else 0.0,
           "spec/draft_ms": 1000 * c.get("draft_s", 0.0),
           "spec/decode_forwards": c.get("forwards", 0.0),
           "spec/decode_rows": rows,
           "spec/decode_tokens": rows + acc}
    for k, v in c.items():
        if k.startswith("src/accepted/"):
            src = k[len("src/accepted/"):]
            out[f"spec/accepted_tokens/{src}"] = v
            if src == "draft_head":
                out["draft/accept_rate"] = v / max(1.0, c.get(f"src/drafted/{src}", 0.0))
    return out


def rhyme_metrics(f: StepFacts) -> dict[str, Any]:
    """How much the step's responses repeat their prompts' earlier ones (rhymerl.drafting.rhyme):
    the share of counted tokens covered, over the groups that had history."""
    counted = f.counts.get("rhyme/counted", 0.0)
    return {"rhyme/covered_share": f.counts.get("rhyme/covered", 0.0) / counted if counted else 0.0,
            "rhyme/counted_tokens": counted}


def scheduling_metrics(f: StepFacts) -> dict[str, Any]:
    """HistoPipe's counters, and how well the history predicted each group's mean length."""
    out: dict[str, Any] = {k: v for k, v in f.counts.items() if k.startswith("pipe/")}
    out["pipe/workers"] = f.workers
    true_mean = [float(np.mean([len(c.token_ids) for c in o.outputs])) for o in f.outs]
    known = [(p, t) for p, t in zip(f.predicted, true_mean) if p is not None]
    if len(known) >= 3:
        from rhymerl.scheduling import spearman

        out["pipe/length_rank_corr"] = spearman([k[0] for k in known], [k[1] for k in known])
    return out


def merge_counts(first: dict[str, float], more: list[dict[str, float]]) -> dict[str, float]:
    """A step's counters: its rollout's, plus any refill rollouts' (DAPO)."""
    return {k: first.get(k, 0.0) + sum(m.get(k, 0.0) for m in more) for k in first}


def step_metrics(f: StepFacts, t: StepTimes) -> dict[str, Any]:
    """Every metric of one step (the update's own are added by the loop)."""
    return {**reward_metrics(f), **response_metrics(f), **data_metrics(f), **timing_metrics(f, t),
            **speculation_metrics(f), **rhyme_metrics(f), **scheduling_metrics(f)}


def async_metrics(old_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, staleness: int,
                  cap: float) -> dict[str, float]:
    """How far an update's batch is off-policy: policy versions behind, and the importance
    ratio proximal / behaviour over its response tokens (``clipped_frac``: above the cap)."""
    ratio = torch.exp((old_logp - behav_logp).clamp(max=20.0))[mask.bool()]
    if not ratio.numel():
        ratio = torch.ones(1)
    return {"async/staleness_mean": float(staleness), "async/is_ratio_mean": float(ratio.mean()),
            "async/is_ratio_max": float(ratio.max()), "async/clipped_frac": float((ratio > cap).float().mean())}
