"""Building a run's parts from its config, in a fixed order (the order is part of what a seed
means: the reference model's copy and a draft head's initialisation come after the policy's
load): the pinned inputs, the data, the trainer (and an online draft head), the history."""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rhymerl.config import ConfigError, RunConfig, save_config
from rhymerl.data import PromptRow
from rhymerl.data.filters import filter_rows
from rhymerl.data.loader import PromptLoader
from rhymerl.data.splits import task_splits
from rhymerl.device import resolve_dtype
from rhymerl.drafting import trains_draft_head, trains_eagle3
from rhymerl.model import load_pretrained
from rhymerl.rewards import RewardPool, RewardSpec
from rhymerl.tokenizer import tokenizer_fingerprint
from rhymerl.training.run.inputs import check_inputs, record_inputs, with_absolute_paths
from rhymerl.training.sft import CARD, ensure_base_model, sft_output_dir
from rhymerl.training.update.trainer import PolicyTrainer, Trainer


def pinned_inputs(cfg: RunConfig, run_dir: Path, resuming: bool, accept_changed_inputs: bool) -> tuple[RunConfig, Path]:
    """The run's config and base model. A new run records both (config.yaml, inputs.json) once;
    a resumed one checks its inputs against that record, and never trains a new base under its
    checkpoints."""
    if not resuming:  # a run's record is written once, never on resume
        cfg = with_absolute_paths(cfg)
        save_config(cfg, run_dir / "config.yaml")
    if resuming and not cfg.model.path and not (sft_output_dir(cfg) / CARD).exists() \
            and not accept_changed_inputs:
        raise ConfigError(f"{sft_output_dir(cfg)}: the run's base model is gone; restore it, or pass "
                          "--accept-changed-inputs to train a new one and continue anyway")
    base = ensure_base_model(cfg)
    if resuming:
        check_inputs(run_dir, cfg, base, accept_changes=accept_changed_inputs)
    else:
        record_inputs(run_dir, cfg, base)
    return cfg, base


def load_policy(cfg: RunConfig, base: Path, device: torch.device) -> Any:
    """The policy this process trains (one rank) or keeps (many ranks: a CPU copy, which rank 0
    publishes into after each update; the rollout workers sync from it and checkpoints are
    written from it), float32 on CPU."""
    distributed = cfg.trainer.world_size > 1
    on_cpu = device.type == "cpu" or distributed
    return load_pretrained(base, device="cpu" if distributed else device,
                           dtype=torch.float32 if on_cpu else resolve_dtype(cfg.model.dtype))


@dataclass
class RunData:
    """The task's train and held-out rows (filtered to fit the model length) and the loader."""

    train_rows: list[PromptRow]
    val_rows: list[PromptRow]
    dropped_rows: dict[str, int]  # metrics of what the filter dropped
    loader: PromptLoader
    row_of: dict[str, PromptRow]  # train rows by key


def load_data(cfg: RunConfig, tokenizer: Any) -> RunData:
    train_rows, val_rows = task_splits(cfg.data, cfg.seed)
    fit = dict(max_model_len=cfg.rollout.max_model_len, min_response_tokens=cfg.data.min_response_tokens,
               skip_bad_rows=cfg.data.skip_bad_rows)
    train_rows, dropped = filter_rows(train_rows, tokenizer, what="train", **fit)
    val_rows, val_dropped = filter_rows(val_rows, tokenizer, what="held-out", **fit) if val_rows else ([], None)
    dropped_rows = {"data/dropped_overlong": len(dropped.overlong), "data/dropped_unencodable": len(dropped.unencodable)}
    if val_dropped is not None:
        dropped_rows["data/val_dropped"] = len(val_dropped.overlong) + len(val_dropped.unencodable)
    return RunData(train_rows, val_rows, dropped_rows, PromptLoader(train_rows, cfg.trainer.batch_prompts, cfg.seed),
                   {row.key: row for row in train_rows})


def build_trainer(cfg: RunConfig, base: Path, model: Any, device: torch.device) -> tuple[Trainer, Any]:
    """N ranks (trainer.world_size > 1), or the update in this process (with a draft head
    trained online beside the policy, when the drafter has one); returns (trainer, head or None)."""
    total = cfg.trainer.steps * cfg.trainer.ppo_epochs * cfg.trainer.ppo_mini_batches
    if cfg.trainer.world_size > 1:
        from rhymerl.training.update.trainer_group import TrainerGroup

        return TrainerGroup(cfg, base, model, with_ref=cfg.algorithm.kl_coef > 0, total_optimizer_steps=total), None
    ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.algorithm.kl_coef > 0 else None
    head = None
    spec = cfg.rollout.speculative
    if trains_draft_head(spec):
        from rhymerl.training.update.draft_head_trainer import DraftHeadTrainer

        head = DraftHeadTrainer(model, spec.draft_head_lr, device, seed=cfg.seed)
    elif trains_eagle3(spec):
        from rhymerl.training.update.eagle3_trainer import Eagle3Trainer

        head = Eagle3Trainer(model, base, spec.draft_head_lr, device, seed=cfg.seed, steps=spec.model_draft_tokens)
    trainer = PolicyTrainer(model, cfg.trainer, cfg.algorithm, device, ref, total_optimizer_steps=total,
                            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                            draft_head=head)
    return trainer, head


def build_history(cfg: RunConfig, tokenizer: Any):
    """The controller's history store (None when neither drafting nor HistoPipe reads it):
    workers draft from the parts shipped with their work, HistoPipe predicts lengths from it,
    and it is saved with every checkpoint. The rollout phase is its one writer."""
    spec = cfg.rollout.speculative
    if spec.method == "none" and cfg.rollout.schedule != "histopipe":
        return None
    from rhymerl.drafting import HistoryStore

    return HistoryStore(max_rollouts=max(1, spec.history_epochs), tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))


def engines_config(cfg: RunConfig, draft_head: Any, run_dir: Path) -> RunConfig:
    """The config the rollout engines are built from: an Eagle3 head trained online is handed to
    vLLM as the folder of the head it starts from (vLLM builds its drafter from a folder)."""
    if not trains_eagle3(cfg.rollout.speculative):
        return cfg
    head = draft_head.save(run_dir)
    return replace(cfg, rollout=replace(cfg.rollout, speculative=cfg.rollout.speculative.with_(draft_model=str(head))))


def build_rewards(cfg: RunConfig, data: RunData) -> tuple[RewardSpec, RewardPool]:
    """The reward function (one per data source of the run's rows) and its pool of processes."""
    sources = tuple(sorted({r.data_source for r in data.train_rows + data.val_rows}))
    spec = RewardSpec(cfg.data.reward_file, cfg.data.reward_fn_name, sources)
    return spec, RewardPool(spec, workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s)


def build_rollout(cfg: RunConfig, draft_head: Any, run_dir: Path, base: Path, named: dict[str, torch.Tensor],
                  tokenizer: Any, history: Any):
    """The rollout coordinator: its engines (local processes or Ray actors) loaded with ``named``."""
    from rhymerl.distribution.factory import build_coordinator

    return build_coordinator(engines_config(cfg, draft_head, run_dir), base, named, tokenizer=tokenizer,
                             history=history)


def update_threads(cfg: RunConfig, trainer: Trainer) -> int:
    """Threads for an update that overlaps the rollout (async RL, a streamed update): the cores the
    workers leave, a fixed count so its numbers never follow timing. 0: every core (no overlap, or
    the update runs in ranks of its own)."""
    from rhymerl.distribution.factory import trainer_threads_beside_workers

    overlaps = cfg.trainer.async_staleness or cfg.trainer.stream_update
    return trainer_threads_beside_workers(cfg) if overlaps and trainer.in_process else 0
