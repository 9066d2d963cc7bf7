"""Verifiable rewards: a registry keyed by data_source, built-in verifiers, user functions."""
from rhymerl.rewards.math import extract_answer, math_compute_score
from rhymerl.rewards.registry import RewardRegistry, RewardResult, load_reward_file

__all__ = ["RewardRegistry", "RewardResult", "extract_answer", "load_reward_file", "math_compute_score"]
