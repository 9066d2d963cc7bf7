"""Held-out evaluation: greedy (or sampled) accuracy and response lengths."""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from rhymerl.data import PromptRow
from rhymerl.engine import SamplingParams
from rhymerl.llm import LLM
from rhymerl.rewards import RewardCall, RewardResult


class Scorer(Protocol):
    """A :class:`rhymerl.rewards.RewardRegistry` (in process) or :class:`rhymerl.rewards.RewardPool`."""

    def score_many(self, calls: list[RewardCall]) -> list[RewardResult]: ...


def prompt_seed(seed: int, key: str) -> int:
    """One evaluation prompt's sampling seed: its own random streams, not the ones every other
    prompt shares (one seed for all would correlate avg@n across prompts)."""
    return (seed * 1_000_003 + zlib.crc32(key.encode())) & ((1 << 62) - 1)


@dataclass
class EvalResult:
    accuracy: float
    lengths: list[int]
    format_ok: float  # share of responses that ended with a stop token rather than the length cap
    per_prompt: list[float] = field(default_factory=list)  # each prompt's mean reward, in row order

    def length_stats(self) -> dict[str, float]:
        a = np.array(self.lengths)
        return {"min": int(a.min()), "median": float(np.median(a)), "max": int(a.max()), "mean": float(a.mean())}


def evaluate(llm: LLM, rows: list[PromptRow], rewards: Scorer, *, max_tokens: int,
             temperature: float = 0.0, n: int = 1, seed: int = 0) -> EvalResult:
    """Mean reward over ``rows`` (greedy by default; with ``temperature > 0``, the mean over
    ``n`` samples per prompt, i.e. avg@n, each prompt seeded from ``seed`` and its key)."""
    params = [SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, seed=prompt_seed(seed, r.key))
              for r in rows]
    outs = llm.generate([r.prompt for r in rows], params, use_tqdm=False)
    calls, lengths, ok = [], [], []
    for r, o in zip(rows, outs):
        for c in o.outputs:
            calls.append(RewardCall(r.data_source, c.text, r.ground_truth, r.extra_info,
                                    where=f"held-out prompt {r.key} sample {c.index}"))
            lengths.append(len(c.token_ids))
            ok.append(c.finish_reason == "stop")
    scores = [res.score for res in rewards.score_many(calls)]
    per_prompt = [float(np.mean(scores[i * n:(i + 1) * n])) for i in range(len(rows))]
    return EvalResult(float(np.mean(scores)), lengths, float(np.mean(ok)), per_prompt)
