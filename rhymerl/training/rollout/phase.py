"""A step's collect phase: generate for a batch of prompts on the rollout workers, score each
prompt as soon as its samples are all back, write each scored group into the history, and hand
back the step's :class:`~rhymerl.training.rollout.batch.ScoredRollout`; DAPO's filter and the check of
a reward function that fails everywhere sit beside it (:class:`RolloutPhase`)."""
from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable

from rhymerl.algos import informative
from rhymerl.config import RunConfig
from rhymerl.data import PromptRow
from rhymerl.drafting.rhyme import covered_tokens
from rhymerl.engine import RequestOutput, SamplingParams
from rhymerl.rollout_engines import get_engine
from rhymerl.rewards import RewardCall, RewardPool, RewardSpec
from rhymerl.tokenizer import encode_prompt
from rhymerl.training.rollout.batch import GroupScore, KeptBatch, ScoredRollout
from rhymerl.training.rollout.partial import CarriedGroup, merge, paused_samples, step_budget
from rhymerl.training.rollout.policy_versions import PolicyVersions

log = logging.getLogger(__name__)

# The coordinator's counters a step reports as deltas (speculation's work in its rollout).
_SPEC_COUNTERS = ("forwards", "decode_rows", "accepted", "drafted", "draft_s", "generated")


def rollout_seed(seed: int, step: int, key: str) -> int:
    """The sampling seed of one prompt at one step: stable across processes and restarts."""
    return (zlib.crc32(f"{seed}:{step}:{key}".encode()) << 20 | step) & ((1 << 62) - 1)


class RewardFunctionError(RuntimeError):
    """A reward function failed on every response of a step."""


@dataclass
class _Requests:
    """One rollout's requests: carried groups first (continued from their pause), then new rows."""

    reqs: list[Any]  # rhymerl.distribution.RolloutRequest
    rows: list[PromptRow]
    limits: list[int]  # each request's token limit (its pause test)
    carried: list[CarriedGroup]


class RolloutPhase:
    """Generation and scoring for the RL loop. The history's one writer: each group once it is
    whole and scored, with its rewards."""

    def __init__(self, cfg: RunConfig, tokenizer: Any, coordinator: Any, history: Any, rewards: RewardPool,
                 reward_spec: RewardSpec, versions: PolicyVersions, row_of: dict[str, PromptRow],
                 streamed: Callable[[int, list[float | None]], Any]) -> None:
        self.cfg, self.tokenizer, self.coordinator, self.history = cfg, tokenizer, coordinator, history
        self.rewards, self.reward_spec, self.versions, self.row_of = rewards, reward_spec, versions, row_of
        self._streamed = streamed  # the prompt split's update work for a step's groups

    def run(self, rows: list[PromptRow], step: int, carried: list[CarriedGroup] | None = None,
            version: int | None = None, split: bool = False) -> ScoredRollout:
        """Generate for ``rows`` (after the ``carried`` groups, continued from their pause) and
        score each prompt as soon as its samples are all back. Groups paused at this step's
        token budget come back in ``carry``, unscored. ``split``: the prompt split's update work
        starts on each group as it is scored (in the background with ``stream_update``)."""
        q = self._requests(rows, step, carried or [])
        predicted = self.predict(q.rows)  # before this step's lengths join the history
        streamed = self._streamed(step, predicted) if split else None
        budget = self.cfg.rollout.carry_over_tokens
        scored: dict[int, GroupScore] = {}
        whole: dict[int, RequestOutput] = {}
        reward_s = 0.0

        def on_done(i: int, out) -> None:
            nonlocal reward_s
            if i < len(q.carried):
                out = merge(q.carried[i], out)
            whole[i] = out
            if budget and not out.error and paused_samples(out, q.limits[i]):
                return  # paused: scored when the group is whole
            t = time.perf_counter()
            scored[i] = self.score(q.rows[i], out)
            reward_s += time.perf_counter() - t
            if streamed is not None:
                g = scored[i].scores
                trains = not self.cfg.algorithm.dynamic_sampling or informative(g)
                streamed.add(i, out.prompt_token_ids if trains else None, [c.token_ids for c in out.outputs], g)

        before = self._counters()
        t = time.perf_counter()
        self.coordinator.rollout(q.reqs, step, on_done=on_done)  # on_done sees every request
        gen_s = time.perf_counter() - t - reward_s
        out = self._gathered(q, step, whole, scored, predicted, gen_s=gen_s, reward_s=reward_s)
        out.version = self.versions.current if version is None else version
        out.streamed, out.stats = streamed, {**out.stats, **self._counter_deltas(before)}
        return out

    def _requests(self, rows: list[PromptRow], step: int, carried: list[CarriedGroup]) -> _Requests:
        from rhymerl.distribution import RolloutRequest

        r = self.cfg.rollout
        budget = r.carry_over_tokens
        # a paused sample's prefix carries its log-probs; async RL corrects by the sampling
        # policy's; another engine's are checked against the trainer's every step
        logprobs = budget > 0 or self.versions.asynchronous or not get_engine(r.engine).exact_logprobs

        def params(prefix_len: int) -> SamplingParams:
            return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                  max_tokens=step_budget(r.max_tokens, budget, prefix_len), logprobs=logprobs)

        all_rows = [self.row_of[g.key] for g in carried] + rows
        reqs = [RolloutRequest(encode_prompt(self.tokenizer, row.prompt), params(g.prefix_len()), g.seed, g.key,
                               samples=tuple(sorted(g.paused)), prefixes=dict(g.paused))
                for g, row in zip(carried, all_rows)]
        reqs += [RolloutRequest(encode_prompt(self.tokenizer, row.prompt), params(0),
                                rollout_seed(self.cfg.seed, step, row.key), row.key)
                 for row in rows]
        limits = [min(r.max_tokens, r.max_model_len - len(q.prompt_ids)) for q in reqs]
        return _Requests(reqs, all_rows, limits, carried)

    def _gathered(self, q: _Requests, step: int, whole: dict[int, RequestOutput], scored: dict[int, GroupScore],
                  predicted: list[float | None], *, gen_s: float, reward_s: float) -> ScoredRollout:
        """The scored groups (written into the history) and the paused ones, carried."""
        carry: list[CarriedGroup] = []
        rhyme = (0, 0)  # response tokens the prompt's earlier responses cover, of those counted
        done = [i for i in range(len(q.reqs)) if i in scored]
        offpolicy = 0
        for i in range(len(q.reqs)):
            out = whole[i]
            if i not in scored:
                paused = {c.index: (list(c.token_ids), list(c.logprobs or []))
                          for c in paused_samples(out, q.limits[i])}
                since = q.carried[i].since_step if i < len(q.carried) else step
                carry.append(CarriedGroup(q.rows[i].key, q.reqs[i].seed, since,
                                          [c for c in out.outputs if c.index not in paused], paused))
            else:
                if i < len(q.carried):
                    offpolicy += q.carried[i].offpolicy_tokens()
                if self.history is not None and out.error is None:
                    rhyme = _rhyme(self.history, q.rows[i].key, out, rhyme)
                    self.history.add(q.rows[i].key, q.reqs[i].prompt_ids, [c.token_ids for c in out.outputs], step,
                                     scored[i].scores)
        extras: dict[str, list[float]] = {}
        for i in done:
            for k, v in scored[i].extras.items():
                extras.setdefault(k, []).extend(v)
        return ScoredRollout([q.rows[i] for i in done], [whole[i] for i in done], [scored[i].scores for i in done],
                             sum(scored[i].errors for i in done), sum(scored[i].timeouts for i in done),
                             next((scored[i].first_error for i in done if scored[i].first_error), None),
                             extras, [predicted[i] for i in done], gen_s=gen_s, reward_s=reward_s, carry=carry,
                             offpolicy_tokens=offpolicy, continued=sum(i < len(q.carried) for i in done),
                             stats={"rhyme/covered": rhyme[0], "rhyme/counted": rhyme[1]})

    def _counters(self) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        st, pipe = self.coordinator.stats, self.coordinator.pipe
        return ({k: getattr(st, k) for k in _SPEC_COUNTERS}, dict(self.coordinator.source_stats), vars(pipe).copy())

    def _counter_deltas(self, before) -> dict[str, float]:
        """What the rollout added to the coordinator's counters: speculation, sources, HistoPipe."""
        s0, src0, p0 = before
        st, pipe = self.coordinator.stats, self.coordinator.pipe
        return {**{k: getattr(st, k) - s0[k] for k in _SPEC_COUNTERS},
                **{f"src/{k}": v - src0.get(k, 0) for k, v in self.coordinator.source_stats.items()},
                **{f"pipe/{k}": v - p0[k] for k, v in vars(pipe).items()}}

    def predict(self, rows: list[PromptRow]) -> list[float | None]:
        """HistoPipe's length prediction per prompt (None without history), for the trace."""
        if self.history is None:
            return [None] * len(rows)
        from rhymerl.scheduling import predict_lengths

        hist = [self.history.lengths(row.key) for row in rows]
        pred = predict_lengths(hist, self.cfg.rollout.length_stat)
        return [float(p) if h else None for p, h in zip(pred, hist)]

    def score(self, row: PromptRow, out: RequestOutput) -> GroupScore:
        """Score one prompt's responses in the reward pool (each call bounded by reward.timeout_s)."""
        if out.error:
            raise ValueError(f"prompt {row.key}: {out.error}")
        calls = [RewardCall(row.data_source, c.text, row.ground_truth, row.extra_info,
                            where=f"prompt {row.key} sample {c.index}") for c in out.outputs]
        g = GroupScore([], 0, 0, {}, None)
        for res in self.rewards.score_many(calls):
            if res.error:
                g.first_error = g.first_error or res.error
                if res.timed_out:
                    g.timeouts += 1
                else:
                    g.errors += 1
                log.warning(res.error)
            for k, v in res.extra.items():
                g.extras.setdefault(k, []).append(v)
            g.scores.append(res.score)
        return g

    # --- what the step does with a collected batch ----------------------------------------------
    def check_rewards(self, batch: ScoredRollout, step: int) -> None:
        """Broken, not unlucky: an import error or a typo fails every row, and training on
        all-zero rewards would look like a run that learns nothing."""
        scored_n = sum(len(g) for g in batch.scores)
        if scored_n and batch.errors + batch.timeouts == scored_n:
            raise RewardFunctionError(
                f"step {step}: the reward function {self._reward_fn_name(batch.rows[0].data_source)} failed on every "
                f"one of the step's {scored_n} responses ({batch.errors} raised, {batch.timeouts} timed out); "
                f"first: {batch.first_error}")

    def _reward_fn_name(self, data_source: str) -> str:
        spec = self.reward_spec
        if spec.reward_file and data_source in spec.sources:
            return spec.user_fn_name()
        return f"for data_source {data_source!r}"

    def filter(self, batch: ScoredRollout, step: int, next_batch: Callable[[], list[PromptRow]]) -> KeptBatch:
        """The groups the step trains on. DAPO's dynamic sampling drops groups whose rewards
        are all equal (no advantage) and draws up to ``max_resample_batches`` more batches."""
        algo, size = self.cfg.algorithm, self.cfg.trainer.batch_prompts
        kept = KeptBatch(batch.rows, batch.outs, batch.scores, list(batch.carry), gen_s=batch.gen_s,
                         reward_s=batch.reward_s, errors=batch.errors, timeouts=batch.timeouts)
        if not algo.dynamic_sampling:
            return kept
        keep = [i for i, g in enumerate(batch.scores) if informative(g)]
        kept.filtered = len(batch.rows) - len(keep)
        kept.rows = [batch.rows[i] for i in keep]
        kept.outs = [batch.outs[i] for i in keep]
        kept.scores = [batch.scores[i] for i in keep]
        for _ in range(algo.max_resample_batches):
            if len(kept.rows) >= size:
                break
            more = self.run(next_batch(), step)  # synchronous only (config check)
            kept.stats.append(more.stats)
            kept.carry += more.carry
            kept.gen_s += more.gen_s
            kept.reward_s += more.reward_s
            kept.errors += more.errors
            kept.timeouts += more.timeouts
            for row, out, scores in zip(more.rows, more.outs, more.scores):
                if informative(scores):
                    kept.rows.append(row)
                    kept.outs.append(out)
                    kept.scores.append(scores)
        kept.rows, kept.outs, kept.scores = kept.rows[:size], kept.outs[:size], kept.scores[:size]
        return kept


def _rhyme(history: Any, key: str, out: RequestOutput, acc: tuple[int, int]) -> tuple[int, int]:
    """``acc`` plus one group's covered and counted tokens against its prompt's history."""
    earlier = [r for _step, responses, _rewards in history.export(key) for r in responses]
    if not earlier:
        return acc
    hit, total = covered_tokens([c.token_ids for c in out.outputs], earlier)
    return acc[0] + hit, acc[1] + total
