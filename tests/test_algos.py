"""RL algorithms as pure functions, checked against hand-computed values."""
from __future__ import annotations

import pytest
import torch

from rhymerl.algos import (ADV_ESTIMATORS, aggregate, kl_penalty, overlong_penalty, ppo_clip_loss)


def test_grpo_and_variants():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = ADV_ESTIMATORS["grpo"](scores, group)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased, as verl
    assert torch.allclose(adv[:4], (torch.tensor([1.0, 0, 0, 1]) - 0.5) / (std + 1e-6))
    assert torch.all(adv[4:] == 0)  # equal rewards teach nothing
    assert torch.allclose(ADV_ESTIMATORS["drgrpo"](scores, group)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    rloo = ADV_ESTIMATORS["rloo"](scores, group)
    assert rloo[0] == pytest.approx(1.0 - 1 / 3) and rloo[1] == pytest.approx(0.0 - 2 / 3)
    rpp = ADV_ESTIMATORS["reinforce_plus_plus_baseline"](scores, group)
    assert rpp.mean().abs() < 1e-6 and rpp.std(unbiased=False) == pytest.approx(1.0, abs=1e-4)


def test_ppo_clip_asymmetric_and_dual_clip():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 5.0]]))
    mask = torch.ones(1, 4)
    pos = torch.ones(1, 1)
    loss, m = ppo_clip_loss(logp, old, pos, mask, clip_low=0.2, clip_high=0.28)
    # positive advantage: ratio clipped above at 1.28, not below (min of the two losses)
    expected = -(1.28 + 0.5 + 1.1 + 1.28) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert m["pg_clipfrac"].item() == pytest.approx(0.5)
    neg = -torch.ones(1, 1)
    loss, m = ppo_clip_loss(logp, old, neg, mask, clip_low=0.2, clip_high=0.28, clip_c=3.0)
    # negative advantage: max(-A r, -A clip(r)) then dual clip caps it at 3
    expected = (1.5 + 0.8 + 1.1 + 3.0) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(0.25)


def test_aggregation_modes_and_accumulation():
    loss = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(2.0)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 3.0) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((3.0 + 3.0) / 2)
    # fixed denominators make micro-batch sums equal the whole batch's value
    parts = sum(aggregate(loss[i:i + 1], mask[i:i + 1], "token-mean", norm_tokens=3.0) for i in range(2))
    assert parts.item() == pytest.approx(2.0)


def test_kl_estimators_and_overlong():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert torch.allclose(kl_penalty(logp, ref, "k1"), logp - ref)
    d = ref - logp
    assert torch.allclose(kl_penalty(logp, ref, "low_var_kl"), d.exp() - d - 1)
    assert torch.all(kl_penalty(logp, ref, "low_var_kl") >= 0)
    pen = overlong_penalty(torch.tensor([10, 90, 95, 100]), 100, 10, 1.0)
    assert torch.allclose(pen, torch.tensor([0.0, 0.0, -0.5, -1.0]))
