"""RL algorithms as pure tensor functions, registered by name (verl's ``core_algos`` style).

Shapes: ``B`` responses, ``L`` response tokens (right-padded); ``mask [B, L]`` is 1 on
response tokens. Every function here is testable alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

ADV_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {}
GROUP_LOCAL_ADV: set[str] = set()  # estimators that need a group alone, not the whole batch
POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {}
OFFPOLICY_CORRECTIONS: dict[str, Callable[..., "Correction"]] = {}
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")  # see aggregate()
KL_TYPES = ("k1", "low_var_kl")  # see kl_penalty()


def register_adv_est(name: str, *, group_local: bool = True):
    """Register an advantage estimator; ``group_local=False`` when it normalises over the
    whole batch (then a group cannot be finished before the batch is: no streamed update)."""
    def deco(fn):
        ADV_ESTIMATORS[name] = fn
        if group_local:
            GROUP_LOCAL_ADV.add(name)
        return fn
    return deco


def register_policy_loss(name: str):
    def deco(fn):
        POLICY_LOSSES[name] = fn
        return fn
    return deco


def register_offpolicy_correction(name: str):
    def deco(fn):
        OFFPOLICY_CORRECTIONS[name] = fn
        return fn
    return deco


@dataclass(frozen=True)
class Correction:
    """How the PPO loss treats responses drawn by an older (behaviour) policy: the per-token
    log-probs its ratio is taken against (what the clip is around) and per-token weights on the
    advantage, both ``[B, L]`` and detached."""

    anchor: torch.Tensor
    weights: torch.Tensor


@register_offpolicy_correction("behaviour_clip")
def behaviour_clip(prox_logp: torch.Tensor, behav_logp: torch.Tensor, *, cap: float) -> Correction:
    """PPO on the policy that drew the tokens: the ratio is new / behaviour and the clip is
    around the behaviour policy, no weights. The update then never pushes a token further than
    the clip range from the policy that sampled it, however far the weights have moved since;
    the proximal anchor bounds the move only from the update's start, so a token the live
    weights already drifted on is pushed again each stale step (on the main job's recipe the
    policy's KL per step then grew 20-fold late in training)."""
    return Correction(behav_logp.detach(), torch.ones_like(prox_logp))


@register_offpolicy_correction("tis")
def truncated_is_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor, *, cap: float) -> Correction:
    """Decoupled PPO: the clip is around the proximal policy (the update's start) and each
    token is weighted by ``min(exp(prox - behav), cap)``, correcting for the policy that
    actually sampled it."""
    w = torch.exp((prox_logp - behav_logp).clamp(max=20.0)).clamp(max=cap).detach()
    return Correction(prox_logp.detach(), w)


@register_offpolicy_correction("none")
def no_correction(prox_logp: torch.Tensor, behav_logp: torch.Tensor, *, cap: float) -> Correction:
    """Responses treated as drawn by the proximal policy (clip around it, weights 1)."""
    return Correction(prox_logp.detach(), torch.ones_like(prox_logp))


def _group_stats(scores: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-response group mean, std (unbiased, 0 for singletons) and group size."""
    n_groups = int(group.max()) + 1 if group.numel() else 0
    ones = torch.ones_like(scores)
    count = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, group, ones)
    total = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, group, scores)
    mean = total / count
    sq = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, group, (scores - mean[group]) ** 2)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    return mean[group], std[group], count[group]


@register_adv_est("grpo")
def grpo_advantage(scores: torch.Tensor, group: torch.Tensor, *, norm_by_std: bool = True,
                   eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantage ``[B]``: score minus its group's mean, divided by the group's
    std when ``norm_by_std`` (off = Dr. GRPO). ``scores [B]``, ``group [B]`` int group ids."""
    mean, std, _ = _group_stats(scores, group)
    adv = scores - mean
    return adv / (std + eps) if norm_by_std else adv


@register_adv_est("drgrpo")
def drgrpo_advantage(scores: torch.Tensor, group: torch.Tensor, **_: object) -> torch.Tensor:
    """Dr. GRPO: GRPO without the std normalisation ``[B]``."""
    return grpo_advantage(scores, group, norm_by_std=False)


@register_adv_est("rloo")
def rloo_advantage(scores: torch.Tensor, group: torch.Tensor, **_: object) -> torch.Tensor:
    """RLOO ``[B]``: score minus the mean of the *other* responses of its group."""
    mean, _, count = _group_stats(scores, group)
    loo = (mean * count - scores) / (count - 1).clamp(min=1)
    return torch.where(count > 1, scores - loo, torch.zeros_like(scores))


@register_adv_est("reinforce_plus_plus_baseline", group_local=False)
def reinforce_pp_baseline_advantage(scores: torch.Tensor, group: torch.Tensor, *, eps: float = 1e-6,
                                    **_: object) -> torch.Tensor:
    """REINFORCE++-baseline ``[B]``: subtract the group mean, then whiten over the batch."""
    mean, _, _ = _group_stats(scores, group)
    adv = scores - mean
    return (adv - adv.mean()) / (adv.std(unbiased=False) + eps) if adv.numel() > 1 else adv


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, *, norm_tokens: float | None = None,
              norm_seqs: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss ``[B, L]`` to a scalar.

    token-mean: over all response tokens of the batch; seq-mean-token-mean: per-sequence
    token mean, then mean over sequences; seq-mean-token-sum: per-sequence token sum, then
    mean. ``norm_tokens``/``norm_seqs`` fix the denominators across micro-batches, so that
    gradient accumulation gives the full mini-batch's loss.
    """
    if mode == "token-mean":
        return (loss_mat * mask).sum() / (norm_tokens if norm_tokens is not None else mask.sum().clamp(min=1))
    per_seq_tokens = mask.sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = (loss_mat * mask).sum(-1) / per_seq_tokens.clamp(min=1)
    elif mode == "seq-mean-token-sum":
        per_seq = (loss_mat * mask).sum(-1)
    else:
        raise ValueError(f"unknown loss_agg_mode {mode!r}")
    return per_seq.sum() / (norm_seqs if norm_seqs is not None else max(1, loss_mat.shape[0]))


@register_policy_loss("ppo_clip")
def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
                  clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float = 3.0,
                  agg: str = "token-mean", norm_tokens: float | None = None,
                  norm_seqs: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped objective with asymmetric clip (DAPO clip-higher) and dual clip.

    ``logp, old_logp [B, L]`` token log-probs under the current and rollout policies,
    ``adv [B, L]`` (or ``[B, 1]``). Returns the loss and detached metrics
    (``pg_clipfrac``, ``ppo_kl``, ``pg_clipfrac_lower``).
    """
    adv = adv.expand_as(logp)
    ratio = torch.exp(logp - old_logp)
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(l1, l2)
    l3 = -adv * clip_c  # dual clip bounds the loss of negative-advantage tokens
    dual = torch.where(adv < 0, torch.minimum(clipped, l3), clipped)
    loss = aggregate(dual, mask, agg, norm_tokens=norm_tokens, norm_seqs=norm_seqs)
    m = mask.bool()
    with torch.no_grad():
        n = m.sum().clamp(min=1)
        metrics = {
            "pg_clipfrac": ((l2 > l1) & m).sum() / n,
            "pg_clipfrac_lower": ((clipped > l3) & (adv < 0) & m).sum() / n,
            "ppo_kl": ((old_logp - logp) * m).sum() / n,
        }
    return loss, metrics


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate ``[B, L]`` of the policy from the reference.

    k1: ``logp - ref_logp``; low_var_kl (k3): ``exp(ref - logp) - (ref - logp) - 1``, clamped.
    """
    if kind == "k1":
        return logp - ref_logp
    if kind == "low_var_kl":
        d = (ref_logp - logp).clamp(-20, 20)
        return (torch.exp(d) - d - 1).clamp(-10, 10)
    raise ValueError(f"unknown kl type {kind!r}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Token entropy ``[..., ]`` of categorical logits ``[..., V]``."""
    logp = logits.float().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def informative(scores: list[float]) -> bool:
    """DAPO's filter: a group whose rewards are all equal has no advantage to learn from."""
    return max(scores) != min(scores)


def shaped_rewards(scores: torch.Tensor, lengths: torch.Tensor, algo: Any, max_tokens: int,
                   old_logp: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None,
                   mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per response: the score plus DAPO's overlong penalty, minus verl's in-reward KL when it is
    on (each response pays ``kl_coef`` x its summed token KL, from old and reference log-probs);
    and that per-response KL (None when off). ``algo``: the run's algorithm section."""
    reward = scores + overlong_penalty(lengths, max_tokens, algo.overlong_buffer, algo.overlong_penalty)
    if not (algo.use_kl_in_reward and old_logp is not None and ref_logp is not None):
        return reward, None
    seq_kl = (kl_penalty(old_logp, ref_logp, algo.kl_type) * mask).sum(-1)
    return reward - algo.kl_coef * seq_kl, seq_kl


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment ``[B]``: 0 up to ``max_len - buffer``, then linear to
    ``-penalty`` at ``max_len``."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_len - buffer)).clamp(min=0)
    return -penalty * (over / buffer).clamp(max=1.0)
