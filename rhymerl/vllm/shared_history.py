"""History shared by several vLLM engines through a folder (``additional_config["rhymerl"]
["history_dir"]``, on a filesystem every engine mounts): verl and OpenRLHF run one engine per
GPU, and a prompt's next epoch may land on another engine than its last.

Each engine appends the rollouts it recorded as segment files (a :class:`HistoryStore` of just
those rows, checksummed, written to a temporary name and renamed, so a reader never sees half a
segment) and reads the segments of the others, each at most every ``interval_s`` seconds, on
a thread of its own: the drafting step only hands over what to write and takes in what was
read (one folder job at a time; a step never waits for the folder). A damaged or foreign
segment (another tokenizer's fingerprint, a token past this vocabulary) is skipped with one
warning; the folder is kept under ``max_bytes`` by deleting its oldest segments (history only
speeds drafting up: what is lost costs speed).

Under tensor parallelism each rank builds its own proposer and so its own writer; the ranks
record the same rollouts, so the folder holds them once per rank (readers merge duplicates
into one group, doubled). One writer per engine is not enforced: unverified, no GPU here."""
from __future__ import annotations

import logging
import os
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from rhymerl.drafting import HistoryStore

log = logging.getLogger(__name__)

SUFFIX = ".hist.gz"


class SharedHistory:
    """One engine's side of the folder: :meth:`record` what this engine committed,
    :meth:`tick` on every proposer step (it starts a folder job when ``interval_s`` has passed,
    and applies a finished one), :meth:`flush` to wait for the job in flight."""

    def __init__(self, folder: str | Path, store: HistoryStore, *, vocab_size: int, interval_s: float = 5.0,
                 max_bytes: int = 1 << 30, tokenizer_fingerprint: str | None = None) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.store, self.vocab_size, self.fingerprint = store, vocab_size, tokenizer_fingerprint
        self.interval_s, self.max_bytes = interval_s, max_bytes
        self.engine_id = f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._pending = self._empty()
        self._seen: set[str] = set()  # segment names read (or this engine's own); the I/O thread's
        self._last_write = self._last_read = float("-inf")
        self.written = self.read = self.skipped = 0  # segments
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rhymerl-shared-history")
        self._job: Future | None = None

    def _empty(self) -> HistoryStore:
        """What is pending for the next segment: every rollout recorded since the last one."""
        return HistoryStore(max_rollouts=1 << 30, max_total_tokens=self.store.max_total_tokens,
                            tokenizer_fingerprint=self.fingerprint)

    def record(self, key: str, prompt_ids: list[int], responses: list[list[int]], step: int) -> None:
        """A rollout this engine committed to its store: shared with the next write."""
        self._pending.add(key, prompt_ids, responses, step)

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._job is not None:
            if not self._job.done():
                return  # the folder is slow: drafting goes on with the history it has
            self._apply(*self._job.result())
            self._job = None
        write = bool(len(self._pending)) and now - self._last_write >= self.interval_s
        read = now - self._last_read >= self.interval_s
        if not (write or read):
            return
        segment = None
        if write:
            segment, self._pending, self._last_write = self._pending, self._empty(), now
        if read:
            self._last_read = now
        self._job = self._io.submit(self._folder_job, segment, read)

    def flush(self) -> None:
        """Wait for the folder job in flight and take in what it read."""
        if self._job is not None:
            job, self._job = self._job, None
            self._apply(*job.result())

    def _folder_job(self, segment: HistoryStore | None, read: bool) -> tuple[HistoryStore | None, list[HistoryStore]]:
        """On the I/O thread: write ``segment``, read the others' new segments; returns the
        segment back if it could not be written, and the segments read."""
        unwritten = segment if segment is not None and not self._write(segment) else None
        return unwritten, self._read_new() if read else []

    def _apply(self, unwritten: HistoryStore | None, segments: list[HistoryStore]) -> None:
        """On the drafting thread (the store's one writer): what a folder job brought back."""
        if unwritten is not None:  # retried with the next write
            for key, h in unwritten.prompts.items():
                for r in h.rollouts:
                    self._pending.add(key, h.prompt_tail, r.responses, r.step)
        for seg in segments:
            for key, h in seg.prompts.items():
                for r in h.rollouts:
                    # the step the writer recorded: a group served by two engines merges its halves
                    self.store.add(key, h.prompt_tail, r.responses, r.step, r.rewards)

    def _write(self, segment: HistoryStore) -> bool:
        name = f"{time.time_ns():020d}-{self.engine_id}{SUFFIX}"
        self._seen.add(name)
        try:
            segment.save(self.folder / name)  # atomic: a temporary file renamed into place
        except OSError as e:  # a full or vanished share costs drafts, never the rollout
            log.warning("rhymerl shared history %s: cannot write a segment (%s)", self.folder, e)
            return False
        self.written += 1
        self._bound(keep=name)
        return True

    def _segments(self) -> list[Path]:
        try:
            return sorted(p for p in self.folder.iterdir() if p.name.endswith(SUFFIX))
        except OSError:
            return []

    def _read_new(self) -> list[HistoryStore]:
        out = []
        for path in self._segments():
            if path.name in self._seen:
                continue
            self._seen.add(path.name)
            if not path.exists():  # deleted by the folder's bound since it was listed
                continue
            seg = HistoryStore.load(path, vocab_size=self.vocab_size, max_total_tokens=self.store.max_total_tokens,
                                    tokenizer_fingerprint=self.fingerprint,
                                    max_bytes=64 * self.store.max_total_tokens + (1 << 20))
            if self.fingerprint and len(seg) and seg.tokenizer_fingerprint != self.fingerprint:
                log.warning("rhymerl shared history %s: no tokenizer fingerprint (this engine's is %s); discarded",
                            path, self.fingerprint)  # (another fingerprint: load said so)
                seg = HistoryStore()
            if not len(seg):  # damaged or foreign: HistoryStore.load said why, once
                self.skipped += 1
                continue
            out.append(seg)
            self.read += 1
        return out

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
