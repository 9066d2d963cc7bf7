"""Per-prompt history of responses: what HistoSpec drafts from and HistoPipe predicts lengths from.

Keyed by a stable prompt key (dataset index or prompt hash). Each prompt keeps its last
``max_rollouts`` rollouts (a rollout = the group of n responses of one step), with rewards
and lengths; a global token cap evicts the oldest rollouts first. Saved as gzipped JSON
with a SHA-256 checksum and the tokenizer's fingerprint: a store that fails either check
is discarded with a warning, because history only ever accelerates, it never breaks a run.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

from rhymerl.atomic_io import atomic_write_bytes

log = logging.getLogger(__name__)
FORMAT_VERSION = 1


@dataclass
class Rollout:
    step: int
    responses: list[list[int]]
    rewards: list[float | None] = field(default_factory=list)

    @property
    def lengths(self) -> list[int]:
        return [len(r) for r in self.responses]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


@dataclass
class PromptHistory:
    prompt_tail: list[int]
    rollouts: deque[Rollout] = field(default_factory=deque)
    # Drawn from the store's one counter whenever this prompt's rollouts or rewards change, so a
    # prompt dropped and recorded again (``put``) never gets back a revision an index was built at.
    revision: int = 0


class HistoryStore:
    def __init__(self, max_rollouts: int = 1, max_total_tokens: int = 50_000_000, prompt_tail: int = 5,
                 tokenizer_fingerprint: str | None = None) -> None:
        self.max_rollouts, self.max_total_tokens, self.prompt_tail = max_rollouts, max_total_tokens, prompt_tail
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.prompts: dict[str, PromptHistory] = {}
        self._order: OrderedDict[tuple[str, int], None] = OrderedDict()  # (key, step) oldest first
        self.total_tokens = 0
        self.version = 0  # bumps on every change; drafters rebuild indices lazily
        self._revisions = 0  # store-wide and monotonic: the source of every PromptHistory.revision
        # (key, step) of every rollout added, in order, so an index over all prompts appends what is
        # new without a pass over every prompt; entry i sits at position _log_base + i
        self._log: list[tuple[str, int]] = []
        self._log_base = 0

    def _touch(self, h: PromptHistory) -> None:
        self._revisions += 1
        h.revision = self._revisions

    def __contains__(self, key: str) -> bool:
        return key in self.prompts and bool(self.prompts[key].rollouts)

    def __len__(self) -> int:
        return len(self.prompts)

    def add(self, key: str, prompt_ids: list[int], responses: list[list[int]], step: int,
            rewards: list[float | None] | None = None) -> None:
        """Record one rollout (all responses of one prompt in one step)."""
        h = self.prompts.setdefault(key, PromptHistory(list(prompt_ids[-self.prompt_tail:])))
        h.prompt_tail = list(prompt_ids[-self.prompt_tail:])
        self._touch(h)
        r = Rollout(step, [list(x) for x in responses], list(rewards) if rewards else [None] * len(responses))
        same = next((x for x in h.rollouts if x.step == step), None)
        at = next((i for i, x in enumerate(h.rollouts) if x.step > step), len(h.rollouts))  # step order
        if same is not None:  # the same step again: merge (a group's samples split between engines)
            same.responses += r.responses
            same.rewards += r.rewards
            self.total_tokens += r.num_tokens
        elif not (at == 0 and h.rollouts and len(h.rollouts) >= self.max_rollouts):
            # (a late rollout older than every kept one in a full window never displaces newer data)
            h.rollouts.insert(at, r)
            self._order[(key, step)] = None
            self._log.append((key, step))
            if len(self._log) > 2 * len(self._order) + 1024:  # cursors older than the kept half read everything
                cut = len(self._log) // 2
                del self._log[:cut]
                self._log_base += cut
            self.total_tokens += r.num_tokens
            while len(h.rollouts) > self.max_rollouts:
                self._drop(key, h.rollouts[0].step)
        self._evict()
        self.version += 1

    def set_rewards(self, key: str, step: int, rewards: list[float]) -> None:
        h = self.prompts.get(key)
        if h is None:
            return
        for r in h.rollouts:
            if r.step == step and len(r.rewards) == len(rewards):
                r.rewards = list(rewards)
                self._touch(h)
                self.version += 1

    def _drop(self, key: str, step: int) -> None:
        h = self.prompts[key]
        self._touch(h)
        for r in list(h.rollouts):
            if r.step == step:
                h.rollouts.remove(r)
                self.total_tokens -= r.num_tokens
        self._order.pop((key, step), None)
        if not h.rollouts:
            del self.prompts[key]

    def log_end(self) -> int:
        """A cursor past every rollout added so far (for :meth:`added_since`)."""
        return self._log_base + len(self._log)

    def added_since(self, cursor: int) -> list[tuple[str, int]] | None:
        """``(key, step)`` of the rollouts added since ``cursor`` (from :meth:`log_end`), oldest
        first; None when the log no longer reaches back that far or the contents were replaced
        (read every prompt)."""
        if cursor < self._log_base:
            return None
        return self._log[cursor - self._log_base:]

    def next_step(self, key: str) -> int:
        """The label of a new rollout of ``key`` with no step of its own: one past its newest."""
        h = self.prompts.get(key)
        return h.rollouts[-1].step + 1 if h is not None and h.rollouts else 1

    def lengths(self, key: str) -> list[int]:
        """Response lengths of a prompt's stored rollouts (all kept epochs)."""
        h = self.prompts.get(key)
        return [n for r in h.rollouts for n in r.lengths] if h else []

    def export(self, key: str) -> list[tuple[int, list[list[int]], list[float | None]]]:
        """One prompt's stored rollouts as plain data ``(step, responses, rewards)``, oldest first:
        what a rollout worker on another process needs to draft for it."""
        h = self.prompts.get(key)
        return [(r.step, r.responses, r.rewards) for r in h.rollouts] if h else []

    def put(self, key: str, prompt_ids: list[int],
            rollouts: list[tuple[int, list[list[int]], list[float | None]]]) -> None:
        """Make ``rollouts`` (from :meth:`export`) this prompt's whole history."""
        h = self.prompts.get(key)
        if h is not None and [(r.step, len(r.responses), r.rewards) for r in h.rollouts] == \
                [(s, len(x), list(w)) for s, x, w in rollouts]:
            return  # already current: keep the drafter's cached index
        for step in [r.step for r in h.rollouts] if h else []:
            self._drop(key, step)
        for step, responses, rewards in rollouts:
            self.add(key, prompt_ids, responses, step, rewards)

    def replace_with(self, other: "HistoryStore") -> None:
        """Take ``other``'s contents in place (drafters holding this store see them), within this
        store's own caps: the configured rollouts per prompt and token budget win over the ones
        ``other`` was saved with (the oldest rollouts beyond them are dropped)."""
        self.prompt_tail = other.prompt_tail
        self.tokenizer_fingerprint = other.tokenizer_fingerprint or self.tokenizer_fingerprint
        self.prompts, self._order, self.total_tokens = other.prompts, other._order, other.total_tokens
        self._log_base += len(self._log) + 1  # every cursor now reads everything
        self._log = []
        # Revisions continue past both stores' so no cached index can match a taken-over prompt.
        self._revisions = max(self._revisions, other._revisions)
        for h in self.prompts.values():
            self._touch(h)
        for key, h in list(self.prompts.items()):
            while len(h.rollouts) > self.max_rollouts:
                self._drop(key, h.rollouts[0].step)
        self._evict()
        self.version += 1

    def _evict(self) -> None:
        """Oldest recorded rollouts first, until the token budget holds."""
        while self.total_tokens > self.max_total_tokens and self._order:
            k, s = next(iter(self._order))
            self._drop(k, s)

    # --- persistence -------------------------------------------------------------------
    def _payload(self) -> dict:
        return {
            "version": FORMAT_VERSION,
            "tokenizer": self.tokenizer_fingerprint,
            "max_rollouts": self.max_rollouts,
            "prompt_tail": self.prompt_tail,
            "prompts": {k: {"tail": h.prompt_tail,
                            "rollouts": [{"step": r.step, "responses": r.responses, "rewards": r.rewards}
                                         for r in h.rollouts]}
                        for k, h in self.prompts.items()},
        }

    def save(self, path: str | Path) -> None:
        body = json.dumps(self._payload(), separators=(",", ":"), sort_keys=True)
        doc = json.dumps({"sha256": hashlib.sha256(body.encode()).hexdigest(), "body": body})
        atomic_write_bytes(path, gzip.compress(doc.encode(), compresslevel=6))

    @classmethod
    def load(cls, path: str | Path, *, tokenizer_fingerprint: str | None = None,
             max_total_tokens: int = 50_000_000, vocab_size: int | None = None,
             max_bytes: int = 1 << 30) -> "HistoryStore":
        """Load a saved store; on any corruption, a foreign tokenizer, a token id outside
        ``vocab_size`` (it would crash generation on every resume) or a body over ``max_bytes``
        once unzipped, warn and return an empty one."""
        empty = cls(tokenizer_fingerprint=tokenizer_fingerprint, max_total_tokens=max_total_tokens)
        try:
            with gzip.open(path, "rb") as f:
                raw = f.read(max_bytes + 1)  # bounded: a small file may unzip to gigabytes
            if len(raw) > max_bytes:
                raise ValueError(f"unzips to more than {max_bytes} bytes")
            doc = json.loads(raw.decode())
            body = doc["body"]
            if hashlib.sha256(body.encode()).hexdigest() != doc["sha256"]:
                raise ValueError("checksum mismatch")
            data = json.loads(body)
            if data.get("version") != FORMAT_VERSION:
                raise ValueError(f"format version {data.get('version')} (expected {FORMAT_VERSION})")
            if tokenizer_fingerprint and data["tokenizer"] and data["tokenizer"] != tokenizer_fingerprint:
                log.warning("history store %s belongs to another tokenizer (%s != %s); discarded",
                            path, data["tokenizer"], tokenizer_fingerprint)
                return empty
            # A body with a valid checksum can still be malformed (written by other code, or
            # by hand): every field is checked inside this guard, like any other bad store.
            store = cls(max_rollouts=_positive_int(data["max_rollouts"]), max_total_tokens=max_total_tokens,
                        prompt_tail=_positive_int(data["prompt_tail"]), tokenizer_fingerprint=data["tokenizer"])
            rows = []
            for k, h in data["prompts"].items():
                tail = _token_list(h["tail"], vocab_size)
                for r in h["rollouts"]:
                    responses = [_token_list(x, vocab_size) for x in r["responses"]]
                    rewards = r["rewards"]
                    if not isinstance(rewards, list) or len(rewards) != len(responses) or not all(
                            w is None or isinstance(w, (int, float)) and not isinstance(w, bool) for w in rewards):
                        raise ValueError(f"prompt {k!r}: rewards do not match its responses")
                    rows.append((_int(r["step"]), str(k), tail, responses, rewards))
            for step, key, tail, responses, rewards in sorted(rows, key=lambda x: x[0]):
                store.add(key, tail, responses, step, rewards)
        except Exception as e:  # noqa: BLE001 - a broken history must never stop training
            log.warning("history store %s discarded (%s: %s); continuing without drafts from history",
                        path, type(e).__name__, e)
            return empty
        return store


def _int(x: object) -> int:
    if not isinstance(x, int) or isinstance(x, bool):
        raise ValueError(f"expected an integer, got {x!r}")
    return x


def _positive_int(x: object) -> int:
    if _int(x) <= 0:
        raise ValueError(f"expected a positive integer, got {x!r}")
    return x  # type: ignore[return-value]


def _token_list(x: object, vocab_size: int | None = None) -> list[int]:
    if not isinstance(x, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x):
        raise ValueError("expected a list of token ids")
    if vocab_size is not None and any(t >= vocab_size for t in x):
        raise ValueError(f"a token id beyond the vocabulary ({max(x)} >= {vocab_size})")
    return x
