"""Prompt data: verl-layout files, built-in task splits, and the stateful loader."""
from rhymerl.data.dataset import DatasetError, PromptRow, load_dataset_files, parse_row, task_dataset, write_jsonl

__all__ = ["DatasetError", "PromptRow", "load_dataset_files", "parse_row", "task_dataset", "write_jsonl"]
