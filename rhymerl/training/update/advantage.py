"""A kept batch's old (and reference) log-probs, its rewards shaped by the algorithm, and its
advantages: what the update needs beyond the tokens."""
from __future__ import annotations

import time

import torch

from rhymerl.algos import ADV_ESTIMATORS, shaped_rewards
from rhymerl.config import RunConfig
from rhymerl.training.metrics import async_metrics
from rhymerl.training.rollout.batch import UpdateResult
from rhymerl.training.update.trainer import Experience, Trainer


def advantages(trainer: Trainer, cfg: RunConfig, exp: Experience, scores: list[float], lengths: list[int],
               groups: list[int], staleness: int | None) -> UpdateResult:
    """Fills ``exp``'s old log-probs and advantages. ``staleness``: how many updates the drawing
    policy is behind (async RL; None when synchronous), for the off-policy metrics."""
    algo = cfg.algorithm
    res = UpdateResult()
    t = time.perf_counter()
    trainer.compute_logps(exp)
    res.old_s = time.perf_counter() - t
    if staleness is not None:
        assert exp.old_logp is not None and exp.behav_logp is not None
        res.metrics.update(async_metrics(exp.old_logp, exp.behav_logp, exp.response_mask, staleness, algo.is_cap))
    res.rewards, seq_kl = shaped_rewards(torch.tensor(scores, dtype=torch.float32), torch.tensor(lengths), algo,
                                         cfg.rollout.max_tokens, exp.old_logp, exp.ref_logp, exp.response_mask)
    if seq_kl is not None:
        res.metrics["critic/kl_in_reward"] = float(seq_kl.mean())
    res.advantages = ADV_ESTIMATORS[algo.adv_estimator](res.rewards, torch.tensor(groups),
                                                        norm_by_std=algo.norm_adv_by_std)
    exp.advantages = res.advantages.float()
    return res
