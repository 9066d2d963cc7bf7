"""Prompt datasets in verl's row layout, from JSONL or Parquet files or from a built-in task.

A row::

    {"prompt": "text" | [{"role": "user", "content": "..."}],
     "data_source": "openai/gsm8k",
     "reward_model": {"ground_truth": "72"},
     "extra_info": {"index": 17, ...}}

``extra_info.index`` (or the row number) is the prompt's stable key: the history that
HistoSpec and HistoPipe keep is looked up by it, epoch after epoch.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rhymerl.tasks import Task


class DatasetError(ValueError):
    """A malformed file or row; the message names the file, the row and the field."""


@dataclass(frozen=True)
class PromptRow:
    """One training or evaluation prompt."""

    key: str  # stable across epochs
    prompt: str | list[dict[str, Any]]
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)
    origin: str = ""  # where the row came from, for errors: "train.jsonl: row 17"


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise DatasetError(f"{path}: file not found")
    if path.suffix in (".jsonl", ".json"):
        rows = []
        for i, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}: row {i}: invalid JSON ({e.msg})") from e
        return rows
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise DatasetError(f"{path}: unsupported file type {path.suffix!r} (use .jsonl or .parquet)")


def parse_row(raw: Any, *, source: str, row: int) -> PromptRow:
    """Validate one verl-layout row; errors name ``source``, ``row`` and the field."""
    where = f"{source}: row {row}"
    if not isinstance(raw, dict):
        raise DatasetError(f"{where}: expected an object, got {type(raw).__name__}")
    prompt = raw.get("prompt")
    if prompt is None:
        raise DatasetError(f"{where}: missing field 'prompt'")
    if isinstance(prompt, list):
        if not prompt:
            raise DatasetError(f"{where}: field 'prompt' is an empty list of chat messages")
        for j, m in enumerate(prompt):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DatasetError(f"{where}: field 'prompt[{j}]' must be {{'role': str, 'content': str}}")
    elif not isinstance(prompt, str) or not prompt:
        raise DatasetError(f"{where}: field 'prompt' must be a non-empty string or a list of chat messages")
    data_source = raw.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise DatasetError(f"{where}: missing or empty field 'data_source'")
    rm = raw.get("reward_model")
    if not isinstance(rm, dict) or "ground_truth" not in rm:
        raise DatasetError(f"{where}: missing field 'reward_model.ground_truth'")
    extra = raw.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise DatasetError(f"{where}: field 'extra_info' must be an object")
    index = extra.get("index", row)
    if not isinstance(index, (int, str)) or isinstance(index, bool):
        raise DatasetError(f"{where}: field 'extra_info.index' must be an int or a string")
    return PromptRow(key=str(index), prompt=prompt, data_source=data_source,
                     ground_truth=rm["ground_truth"], extra_info=dict(extra), origin=where)


def load_dataset_files(paths: list[str] | str) -> list[PromptRow]:
    """Rows of every file, validated; duplicate prompt keys across files are an error."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    rows: list[PromptRow] = []
    seen: dict[str, str] = {}
    for p in paths:
        for i, raw in enumerate(_read_rows(Path(p))):
            r = parse_row(raw, source=str(p), row=i)
            if r.key in seen:
                raise DatasetError(f"{p}: row {i}: duplicate extra_info.index {r.key!r} (first in {seen[r.key]})")
            seen[r.key] = f"{p}"
            rows.append(r)
    if not rows:
        raise DatasetError(f"{paths}: no rows")
    return rows


def task_dataset(task: Task, n: int, seed: int, *, exclude: set[str] | None = None,
                 key_prefix: str = "") -> list[PromptRow]:
    """``n`` distinct problems of a built-in task; prompts in ``exclude`` are skipped (held-out split)."""
    rng = random.Random(seed)
    rows: list[PromptRow] = []
    seen = set(exclude or ())
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise DatasetError(f"task {task.name}: could not draw {n} distinct prompts")
        p = task.make_problem(rng)
        if str(p.prompt) in seen:
            continue
        seen.add(str(p.prompt))
        rows.append(PromptRow(key=f"{key_prefix}{len(rows)}", prompt=p.prompt, data_source=task.data_source,
                              ground_truth=p.ground_truth,
                              extra_info={"index": len(rows), "solution": p.solution},
                              origin=f"task {task.name}: row {len(rows)}"))
    return rows


def write_jsonl(rows: list[PromptRow], path: str | Path) -> None:
    """Write rows in verl's layout (used to export built-in tasks and in tests)."""
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({"prompt": r.prompt, "data_source": r.data_source,
                                "reward_model": {"ground_truth": r.ground_truth},
                                "extra_info": {**r.extra_info, "index": r.key}}) + "\n")
