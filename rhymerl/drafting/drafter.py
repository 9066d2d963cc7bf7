"""HistoSpec's proposer: drafts from each prompt's history and from its live siblings.

For every running sequence, the last ``pattern_max`` tokens (backing off to
``pattern_min``) are matched against (a) the prompt's stored responses of previous
rollouts, each prefixed with the prompt's last tokens so the first response tokens can be
drafted, and (b) the prompt and the tokens that the request's own samples have produced so
far in this step (siblings rhyme too; this gives drafts in the first epoch). From the
occurrences of the longest match the drafter follows the heaviest branch (a path) or grows
a best-first tree, under the request's adaptive draft length and the batch gate.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from rhymerl.drafting.gate import AcceptanceEstimate, StepOverhead, best_width
from rhymerl.drafting.history import HistoryStore
from rhymerl.drafting.length_policy import POLICIES
from rhymerl.drafting.suffix_index import SuffixIndex
from rhymerl.drafting.tree_builder import draft_path, draft_tree
from rhymerl.engine.cost_model import CostModel
from rhymerl.engine.draft import DraftTree
from rhymerl.engine.sequence import Sequence


@dataclass
class DrafterConfig:
    max_draft: int = 16
    tree_budget: int = 0  # >0: tree drafts of up to this many nodes
    length_policy: str = "additive"
    min_prob: float = 0.1
    pattern_max: int = 7
    pattern_min: int = 3
    siblings: bool = True
    use_history: bool = True
    history_epochs: int = 1
    reward_weight: float = 0.0  # >0: branches of higher-reward responses weigh more
    gate: bool = True
    record: bool = True  # add finished responses to the history
    global_fallback: bool = True  # no long match in this prompt's history or siblings: try every prompt's


@dataclass
class _Live:
    index: SuffixIndex
    members: dict[int, tuple[int, Sequence]] = field(default_factory=dict)  # sample -> (id in index, seq)
    finished: int = 0
    synced: int = -1  # the drafter's propose() call its members' tokens were last indexed at


class HistoryDrafter:
    """A :class:`rhymerl.engine.Proposer` drafting from history and siblings."""

    def __init__(self, cfg: DrafterConfig | None = None, store: HistoryStore | None = None) -> None:
        self.cfg = cfg or DrafterConfig()
        self.store = store if store is not None else HistoryStore(max_rollouts=self.cfg.history_epochs)
        self.policy, cap = POLICIES[self.cfg.length_policy]
        self.cap = min(cap, self.cfg.max_draft)
        self.max_nodes = max(self.cfg.tree_budget, self.cap)
        self.cost_model: CostModel | None = None
        self.acceptance = AcceptanceEstimate()
        self.overhead = StepOverhead()
        self.step = 0
        self._indices: dict[str, tuple[int, SuffixIndex]] = {}
        self._live: dict[object, _Live] = {}
        self._pending: dict[int, list[Sequence]] = {}
        self._last_depth: dict[int, int] = {}
        self._build_s = 0.0
        self._fill = 1.0  # EMA of drafted length / cap: how full drafts turn out to be
        self._tick = 0  # propose() calls so far
        self._global_idx: SuffixIndex | None = None
        self._global_steps: dict[str, int] = {}  # prompt key -> newest rollout step in the global index
        self._global_version = -1
        self._global_tokens = 0

    # --- engine hooks -----------------------------------------------------------------
    @property
    def wants_cost_model(self) -> bool:
        return self.cfg.gate

    def attach_cost_model(self, cost: CostModel) -> None:
        self.cost_model = cost

    def begin(self, step: int) -> None:
        """A new rollout step starts: finished responses are recorded under this step.

        The history may have changed, so the acceptance estimate is pulled halfway back to
        its prior and full drafts are expected again. (Relaxing only when the store changed
        was tried: it kept the pessimism of a warm-up call and cost 15 % of tokens per
        forward in `bench spec`, for no measurable gain in a first epoch.)
        """
        self.step = step
        self.overhead = StepOverhead()  # fresh measurements per rollout step
        self._fill = max(self._fill, 0.5)  # new history: expect drafts again
        self.acceptance.relax(0.5)
        self._prune_indices()

    def _prune_indices(self) -> None:
        """Drop the indices of prompts the store no longer holds (evicted by its caps), so this
        cache never outgrows the store it mirrors."""
        for key in [k for k in self._indices if k not in self.store.prompts]:
            del self._indices[key]

    def propose(self, seqs: list[Sequence]) -> list[DraftTree | None]:
        cfg = self.cfg
        self._tick += 1
        caps = []
        for s in seqs:
            if s.draft_len == 0:
                s.draft_len = 2
            caps.append(max(0, min(s.draft_len, self.cap, s.limit - len(s.output_ids) - 1)))
        if cfg.siblings:
            self._register_live(seqs)
        alpha = self.acceptance.alpha
        over = self.overhead.factor(len(seqs))
        # Before drafting anything: would drafts as full as they have recently been pay at
        # this batch size, and up to how many tokens? Skip the drafting work that cannot pay.
        expect = [round(c * self._fill) for c in caps]
        k_pre = best_width(self.cost_model, expect, alpha, self.cap, over) if cfg.gate else self.cap
        if k_pre == 0:
            # drift back toward full drafts, so that skipping does not become permanent
            self._fill = 0.95 * self._fill + 0.05
            return [None] * len(seqs)
        if k_pre < max(expect):  # the gate would cut even drafts of the expected length here
            caps = [min(c, k_pre) for c in caps]
        drafts: list[DraftTree | None] = []
        lengths: list[int] = []
        for s, cap in zip(seqs, caps):
            d = self._draft(s, cap) if cap > 0 else None
            drafts.append(d)
            lengths.append(len(d) if d is not None else 0)
        if sum(caps):
            self._fill = 0.8 * self._fill + 0.2 * min(1.0, sum(lengths) / sum(caps))
        k = best_width(self.cost_model, lengths, alpha, self.max_nodes, over) if cfg.gate else self.max_nodes
        if k == 0:
            # The drafts found do not pay: expect less next time, so that the check above skips
            # the drafting work until drafts may have grown (it drifts back up).
            self._fill *= 0.5
            return [None] * len(seqs)
        out = [_truncate(d, k) if d is not None and len(d) > k else d for d in drafts]
        if cfg.tree_budget > 0:
            self._last_depth = {id(s): d.depth for s, d in zip(seqs, out) if d is not None}
        return out

    def gate_state(self) -> dict:
        """What the gate has learnt (acceptance, measured overheads, draft fill, and the cost
        model measured at start-up), as plain data: a resumed run drafts as this one would."""
        return {"acceptance": [self.acceptance.succ, self.acceptance.fail],
                "overhead": {"plain": sorted(self.overhead.plain.items()), "spec": sorted(self.overhead.spec.items())},
                "fill": self._fill,
                "cost": sorted([b, t, c] for (b, t), c in self.cost_model.table.items())
                if self.cost_model is not None else None}

    def load_gate_state(self, state: dict) -> None:
        """Inverse of :meth:`gate_state`; a malformed state is ignored with a warning (speed only)."""
        try:
            succ, fail = (float(x) for x in state["acceptance"])
            plain = {int(b): float(r) for b, r in state["overhead"]["plain"]}
            spec = {int(b): float(r) for b, r in state["overhead"]["spec"]}
            fill = float(state["fill"])
            cost = None if state.get("cost") is None else \
                CostModel({(int(b), int(t)): float(c) for b, t, c in state["cost"]})
        except (KeyError, TypeError, ValueError) as e:
            import logging

            logging.getLogger(__name__).warning("speculation gate state ignored (%s)", e)
            return
        self.acceptance.succ, self.acceptance.fail = succ, fail
        self.overhead.plain, self.overhead.spec = plain, spec
        self._fill = fill
        if cost is not None and self.cost_model is not None:
            self.cost_model = cost

    def observe_time(self, B: int, width: int, seconds: float) -> None:
        """The engine's measured time of one decode step (drafting included), less the
        one-off cost of building indices this step (amortised over the whole rollout)."""
        seconds, self._build_s = max(1e-9, seconds - self._build_s), 0.0
        if self.cost_model is not None:
            self.overhead.update(self.cost_model, B, width, seconds)

    def observe(self, seqs: list[Sequence], drafted: list[int], accepted: list[int]) -> None:
        # A tree is "fully accepted" when the walk reached its deepest level.
        depths = [self._last_depth.pop(id(s), d) for s, d in zip(seqs, drafted)]
        self.acceptance.update(depths, accepted)
        for s, d, a in zip(seqs, depths, accepted):
            if d:
                s.draft_len = self.policy(s.draft_len, d, a, cap=self.cap)

    def _live_key(self, s: Sequence) -> object:
        """Sequences that share a live index: all samples of a request (siblings)."""
        return s.request_id

    def _live_size(self, s: Sequence) -> int:
        return s.group_size or s.params.n

    def _leave_live(self, seq: Sequence) -> None:
        """A member is done here; the live index goes once all of them are."""
        key = self._live_key(seq)
        live = self._live.get(key)
        if live is not None:
            live.finished += 1
            if live.finished >= self._live_size(seq):
                del self._live[key]

    def on_finish(self, seq: Sequence) -> None:
        self._leave_live(seq)
        if not self.cfg.record or seq.prompt_key is None:
            return
        group = self._pending.setdefault(seq.request_id, [])
        group.append(seq)
        if len(group) == (seq.group_size or seq.params.n):
            del self._pending[seq.request_id]
            group.sort(key=lambda x: x.sample_index)
            self.store.add(seq.prompt_key, seq.prompt_ids, [g.output_ids for g in group], self.step)

    def on_abort(self, seq: Sequence) -> None:
        """A sample left this engine unfinished (moved to another worker): not recorded."""
        self._leave_live(seq)

    # --- drafting -----------------------------------------------------------------------
    def _draft(self, s: Sequence, cap: int) -> DraftTree | None:
        cfg = self.cfg
        ctx_len = cfg.pattern_max
        out = s.output_ids
        context = out[-ctx_len:] if len(out) >= ctx_len else (s.prompt_ids + out)[-ctx_len:]
        occ, m = [], 0
        if cfg.use_history and s.prompt_key is not None:
            idx = self._history_index(s.prompt_key)
            if idx is not None:
                occ, m = idx.match(context, cfg.pattern_max, cfg.pattern_min)
        live = self._live.get(self._live_key(s)) if cfg.siblings else None
        if live is not None:
            self._sync_live(live)
            occ2, m2 = live.index.match(context, cfg.pattern_max, cfg.pattern_min)
            if m2 > m:
                occ, m = occ2, m2
            elif m2 == m and m:
                occ = occ + occ2
        if m < cfg.pattern_max and cfg.global_fallback and cfg.use_history:
            # Responses to other prompts share the task's phrasing; a longer match there beats
            # a shorter one here (a tie keeps this prompt's own, more specific, continuations).
            g = self._global_index()
            if g is not None:
                occ3, m3 = g.match(context, cfg.pattern_max, cfg.pattern_min)
                if m3 > m:
                    occ, m = occ3, m3
        if not occ:
            return None
        if cfg.tree_budget > 0:
            tree, _ = draft_tree(occ, min(cfg.tree_budget, max(cap, 1) * 2), cap, cfg.min_prob)
            return tree if len(tree) else None
        toks, _ = draft_path(occ, cap, cfg.min_prob)
        return DraftTree.path(toks) if toks else None

    def _history_index(self, key: str) -> SuffixIndex | None:
        h = self.store.prompts.get(key)
        if h is None or not h.rollouts:
            return None
        cached = self._indices.get(key)
        if cached is not None and cached[0] == h.revision:
            return cached[1]
        t0 = time.perf_counter()
        idx = SuffixIndex()
        for r in h.rollouts:
            for resp, rew in zip(r.responses, r.rewards):
                w = 1.0 + self.cfg.reward_weight * (rew or 0.0)
                idx.add(self._stored(h.prompt_tail, resp), weight=w, final=True)
        self._indices[key] = (h.revision, idx)
        if len(self._indices) > 2 * len(self.store.prompts) + 64:  # an engine never told of new steps
            self._prune_indices()
        self._build_s += time.perf_counter() - t0
        return idx

    def _global_index(self) -> SuffixIndex | None:
        """One index over every stored response, appended to as prompts get new rollouts;
        rebuilt only when evicted history makes up most of it."""
        st = self.store
        if self._global_version == st.version:
            return self._global_idx
        t0 = time.perf_counter()
        if self._global_idx is None or self._global_tokens > 2 * st.total_tokens + 4096:
            self._global_idx, self._global_tokens, self._global_steps = SuffixIndex(), 0, {}
        for key, h in st.prompts.items():
            newest = self._global_steps.get(key, -1)
            for r in h.rollouts:
                if r.step > newest:
                    for resp in r.responses:
                        self._global_idx.add(list(resp), final=True)
                        self._global_tokens += len(resp)
                    self._global_steps[key] = r.step
        self._global_version = st.version
        self._build_s += time.perf_counter() - t0
        return self._global_idx if len(self._global_idx) else None

    def _register_live(self, seqs: list[Sequence]) -> None:
        """Give new sequences a place in their live index (their tokens are indexed lazily,
        when a draft is actually made, so steps the gate skips cost no indexing)."""
        for s in seqs:
            key = self._live_key(s)
            live = self._live.get(key)
            if live is None:
                live = self._live[key] = _Live(SuffixIndex())
                live.index.add(list(s.prompt_ids), final=False)
            if s.sample_index not in live.members:
                tail = s.prompt_ids[-self.cfg.pattern_max:]
                live.members[s.sample_index] = (live.index.add(list(tail), final=False), s)

    def _sync_live(self, live: _Live) -> None:
        """Index the tokens the live members emitted since the last sync (once per step: every
        member of a group drafts from the same index)."""
        if live.synced == self._tick:
            return
        live.synced = self._tick
        for sid, s in live.members.values():
            toks = live.index.seqs[sid]
            have = len(toks) - min(len(s.prompt_ids), self.cfg.pattern_max)
            if have < len(s.output_ids):
                toks.extend(s.output_ids[have:])
                live.index.extend(sid)

    @staticmethod
    def _stored(prompt_tail: list[int], response: list[int]) -> list[int]:
        """A stored response as indexed: prefixed with the prompt's last tokens."""
        return prompt_tail + response


class SuffixDecodingDrafter(HistoryDrafter):
    """Peer: SuffixDecoding's draft sources (arctic-inference; vLLM's ``suffix`` method),
    re-implemented on our index for when arctic-inference is not installed.

    A tree over past responses — one global tree over all prompts (``per_prompt=False``) or
    one per prompt — stored without the prompt, plus a per-request tree over the request's
    own prompt and output; no sibling samples. Same controller as HistoSpec.
    """

    def __init__(self, store: HistoryStore, *, per_prompt: bool, cfg: DrafterConfig | None = None) -> None:
        cfg = cfg or DrafterConfig()
        cfg.record = False
        cfg.global_fallback = False  # the peer's own sources only
        super().__init__(cfg, store)
        self.per_prompt = per_prompt

    def _live_key(self, s: Sequence) -> object:
        return (s.request_id, s.sample_index)

    def _live_size(self, s: Sequence) -> int:
        return 1

    @staticmethod
    def _stored(prompt_tail: list[int], response: list[int]) -> list[int]:
        return list(response)

    def _history_index(self, key: str) -> SuffixIndex | None:
        # the global tree is HistoSpec's fallback index: every stored response, no prompt prefix
        return super()._history_index(key) if self.per_prompt else self._global_index()


def _truncate(d: DraftTree, k: int) -> DraftTree:
    # Nodes are in best-first order with parents first, so any prefix is a valid tree.
    return DraftTree(d.tokens[:k], d.parents[:k])
