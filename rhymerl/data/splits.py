"""The train / held-out split of a run: built-in task prompts or the user's files."""
from __future__ import annotations

from rhymerl.config import DataSection
from rhymerl.data.dataset import PromptRow, load_dataset_files, task_dataset
from rhymerl.tasks import get_task


def task_splits(data: DataSection, seed: int) -> tuple[list[PromptRow], list[PromptRow]]:
    """(train, held-out) rows. Built-in held-out prompts never occur in the train split."""
    if data.train_files:
        train = load_dataset_files(data.train_files)
        val = load_dataset_files(data.val_files) if data.val_files else []
        return train, val
    task = get_task(data.task)
    val = task_dataset(task, data.num_val, seed=10_000 + seed, key_prefix="val-")
    train = task_dataset(task, data.num_train, seed=20_000 + seed, exclude={str(r.prompt) for r in val})
    return train, val
