"""History shared by several vLLM engines through a folder (``additional_config["rhymerl"]
["history_dir"]``, on a filesystem every engine mounts): verl and OpenRLHF run one engine per
GPU, and a prompt's next epoch may land on another engine than its last.

Each engine appends the rollouts it recorded as segment files (a :class:`HistoryStore` of just
those rows, checksummed, written to a temporary name and renamed, so a reader never sees half a
segment) and reads the segments of the others, each at most every ``interval_s`` seconds. A
damaged or foreign segment is skipped with one warning; the folder is kept under ``max_bytes``
by deleting its oldest segments (history only speeds drafting up: what is lost costs speed)."""
from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

from rhymerl.drafting import HistoryStore

log = logging.getLogger(__name__)

SUFFIX = ".hist.gz"


class SharedHistory:
    """One engine's side of the folder: :meth:`record` what this engine committed,
    :meth:`tick` on every proposer step (it writes and reads when ``interval_s`` has passed)."""

    def __init__(self, folder: str | Path, store: HistoryStore, *, vocab_size: int, interval_s: float = 5.0,
                 max_bytes: int = 1 << 30) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.store, self.vocab_size = store, vocab_size
        self.interval_s, self.max_bytes = interval_s, max_bytes
        self.engine_id = f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._pending = self._empty()
        self._seen: set[str] = set()  # segment names read (or this engine's own)
        self._last_write = self._last_read = float("-inf")
        self.written = self.read = self.skipped = 0  # segments

    def _empty(self) -> HistoryStore:
        """What is pending for the next segment: every rollout recorded since the last one."""
        return HistoryStore(max_rollouts=1 << 30, max_total_tokens=self.store.max_total_tokens)

    def record(self, key: str, prompt_ids: list[int], responses: list[list[int]], step: int) -> None:
        """A rollout this engine committed to its store: shared with the next write."""
        self._pending.add(key, prompt_ids, responses, step)

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if len(self._pending) and now - self._last_write >= self.interval_s:
            self._write()
            self._last_write = now
        if now - self._last_read >= self.interval_s:
            self._read_new()
            self._last_read = now

    def _write(self) -> None:
        name = f"{time.time_ns():020d}-{self.engine_id}{SUFFIX}"
        self._seen.add(name)
        try:
            self._pending.save(self.folder / name)  # atomic: a temporary file renamed into place
        except OSError as e:  # a full or vanished share costs drafts, never the rollout
            log.warning("rhymerl shared history %s: cannot write a segment (%s)", self.folder, e)
            return
        self._pending = self._empty()
        self.written += 1
        self._bound(keep=name)

    def _segments(self) -> list[Path]:
        try:
            return sorted(p for p in self.folder.iterdir() if p.name.endswith(SUFFIX))
        except OSError:
            return []

    def _read_new(self) -> None:
        for path in self._segments():
            if path.name in self._seen:
                continue
            self._seen.add(path.name)
            if not path.exists():  # deleted by the folder's bound since it was listed
                continue
            seg = HistoryStore.load(path, vocab_size=self.vocab_size, max_total_tokens=self.store.max_total_tokens,
                                    max_bytes=64 * self.store.max_total_tokens + (1 << 20))
            if not len(seg):  # damaged or foreign: HistoryStore.load said why, once
                self.skipped += 1
                continue
            for key, h in seg.prompts.items():
                for r in h.rollouts:
                    # the step the writer recorded: a group served by two engines merges its halves
                    self.store.add(key, h.prompt_tail, r.responses, r.step, r.rewards)
            self.read += 1

    def _bound(self, keep: str) -> None:
        """Oldest segments go first while the folder is over ``max_bytes`` (never ``keep``, the
        one just written: the others have yet to read it)."""
        segs = self._segments()
        sizes = {}
        for p in segs:
            try:
                sizes[p] = p.stat().st_size
            except OSError:
                continue
        total = sum(sizes.values())
        for p in segs:
            if total <= self.max_bytes:
                break
            if p in sizes and p.name != keep:
                try:
                    p.unlink()
                except OSError:
                    pass
                total -= sizes[p]
