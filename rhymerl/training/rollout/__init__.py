"""The rollout room: a step's groups generated, scored and filtered (phase), the batches they
make (batch, partial), which policy version draws them (policy_versions), and the checks on
another engine's log-probs and the drafter's health (engine_checks)."""
from rhymerl.training.rollout.batch import GroupScore, KeptBatch, ScoredRollout, UpdateResult
from rhymerl.training.rollout.engine_checks import (
    DrafterHealth,
    LogpGapError,
    check_logp_gap,
    checked_responses,
    logp_gap,
    max_logp_gap,
)
from rhymerl.training.rollout.partial import CarriedGroup
from rhymerl.training.rollout.phase import RewardFunctionError, RolloutPhase, rollout_seed
from rhymerl.training.rollout.policy_versions import PolicyVersions, RolloutTimeout
