"""Decides which sequences run: admission into free KV slots, and retirement of finished ones."""
from __future__ import annotations

from collections import deque

from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.sequence import Sequence, Status


class Scheduler:
    """Waiting queue (FIFO) and the running batch, kept in slot order.

    Samples of one request admitted in the same step form a group that shares one prompt
    prefill. ``max_prefill_tokens`` bounds the padded prefill of one step, so a burst of
    arrivals does not stall the running batch for long.
    """

    def __init__(self, cache: KVCache, max_prefill_tokens: int = 8192) -> None:
        self.cache = cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.max_prefill_tokens = max_prefill_tokens

    def add(self, seqs: list[Sequence]) -> None:
        self.waiting.extend(seqs)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[list[Sequence]]:
        """Move waiting sequences into free slots; returns the prefill groups in slot order."""
        groups: list[list[Sequence]] = []
        free = self.cache.num_slots - len(self.running)
        longest = 0
        while self.waiting and free > 0:
            s = self.waiting[0]
            # A resumed sequence has its own prefix, so it never shares a prefill.
            new_group = not groups or groups[-1][0].request_id != s.request_id or s.resumed or groups[-1][0].resumed
            if new_group:
                longest2 = max(longest, len(s.prefill_ids))
                if groups and longest2 * (len(groups) + 1) > self.max_prefill_tokens:
                    break
                longest = longest2
                groups.append([])
            self.waiting.popleft()
            s.status, s.slot = Status.RUNNING, len(self.running)
            self.running.append(s)
            groups[-1].append(s)
            free -= 1
        return groups

    def remove(self, s: Sequence) -> None:
        """Take one sequence out, waiting or running (an abort; its slot is freed)."""
        if s.status is Status.WAITING:
            self.waiting.remove(s)
            s.status = Status.FINISHED
        elif s.status is Status.RUNNING:
            self.retire([s])

    def retire(self, finished: list[Sequence]) -> None:
        """Free the slots of finished sequences, moving the last running one into each hole."""
        for s in sorted(finished, key=lambda x: x.slot, reverse=True):
            last = self.running[-1]
            if last is not s:
                self.cache.move(last.slot, s.slot, last.cache_len)
                last.slot = s.slot
                self.running[s.slot] = last
            self.running.pop()
            s.status, s.slot = Status.FINISHED, -1
