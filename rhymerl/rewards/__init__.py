"""Verifiable rewards: a registry keyed by data_source, built-in verifiers, user functions,
and a process pool that bounds each call's time."""
from rhymerl.rewards.math import extract_answer, math_compute_score
from rhymerl.rewards.pool import RewardPool
from rhymerl.rewards.registry import RewardCall, RewardRegistry, RewardResult, RewardSpec, load_reward_file

__all__ = ["RewardCall", "RewardPool", "RewardRegistry", "RewardResult", "RewardSpec", "extract_answer",
           "load_reward_file", "math_compute_score"]
