"""Files a resume reads back: written atomically, read tolerantly.

A write goes to a temporary file beside the target, is flushed and fsynced, then renamed
over the target (and the folder fsynced), so a kill at any moment leaves either the old
file or the new one, never a torn mix. Append-only JSONL logs cannot be renamed on every
line; a kill can tear their last line, which :func:`read_jsonl` drops with a warning.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    """Flush a file written by other code (safetensors, torch.save) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (before renaming a finished folder into place)."""
    for p in sorted(root.rglob("*")):
        if p.is_file():
            fsync_file(p)
    for d in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
        fsync_dir(d)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Replace ``path`` by ``data``: temporary file, fsync, rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The objects of a JSONL log. A last line that does not parse (a write torn by a kill)
    is dropped with a warning; a bad line before the last is corruption, an error naming
    the file and the line."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not an object")
        except ValueError as e:
            if i == len(lines) - 1:
                log.warning("%s: last line %d is torn (%s); dropped", path, i + 1, e)
                break
            raise ValueError(f"{path}: line {i + 1} is not a JSON object ({e})") from e
        rows.append(row)
    return rows


def rewrite_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Replace a JSONL log by ``rows`` atomically (on resume: the lines up to the checkpoint)."""
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
