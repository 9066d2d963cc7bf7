"""The run room: what a run is built from (builder), its pinned inputs (inputs), the settings a
resume may change (settings), and what a checkpoint restores beside the weights (state)."""
from rhymerl.training.run.builder import (
    build_history,
    build_rewards,
    build_rollout,
    build_trainer,
    load_data,
    load_policy,
    pinned_inputs,
    update_threads,
)
from rhymerl.training.run.inputs import with_absolute_paths
from rhymerl.training.run.settings import continued_config, read_run_config
from rhymerl.training.run.state import read_run_state, restore_history
