"""Held-out evaluation: greedy (or sampled) accuracy and response lengths."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rhymerl.data import PromptRow
from rhymerl.engine import LLM, SamplingParams
from rhymerl.rewards import RewardRegistry


@dataclass
class EvalResult:
    accuracy: float
    lengths: list[int]
    format_ok: float  # share of responses that ended with a stop token rather than the length cap

    def length_stats(self) -> dict[str, float]:
        a = np.array(self.lengths)
        return {"min": int(a.min()), "median": float(np.median(a)), "max": int(a.max()), "mean": float(a.mean())}


def evaluate(llm: LLM, rows: list[PromptRow], rewards: RewardRegistry, *, max_tokens: int,
             temperature: float = 0.0, n: int = 1, seed: int = 0) -> EvalResult:
    """Mean reward over ``rows`` (greedy by default; with ``temperature > 0``, the mean over
    ``n`` seeded samples per prompt, i.e. avg@n)."""
    params = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, seed=seed)
    outs = llm.generate([r.prompt for r in rows], params, use_tqdm=False)
    scores, lengths, ok = [], [], []
    for r, o in zip(rows, outs):
        for c in o.outputs:
            scores.append(rewards.score(r.data_source, c.text, r.ground_truth, r.extra_info).score)
            lengths.append(len(c.token_ids))
            ok.append(c.finish_reason == "stop")
    return EvalResult(float(np.mean(scores)), lengths, float(np.mean(ok)))
