"""The main job: ``rhymerl train``.

One step reads top to bottom as named phases (:meth:`RLRun.train_step`):

    collect -> check rewards -> filter -> advantages -> update -> sync -> metrics and trace

Synchronous (``trainer.async_staleness=0``): each step generates with the weights it trains
(rollout seeded per step and prompt key), so every response of step t comes from the weights
of step t. Async (S >= 1): :class:`~rhymerl.training.policy_versions.PolicyVersions` decides
which version draws each batch. Metrics are pure functions (:mod:`.step_metrics`).
"""
from __future__ import annotations

import copy
import json
import logging
import time
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from rhymerl.algos import ADV_ESTIMATORS, informative, shaped_rewards
from rhymerl.atomic_io import atomic_write_text, fsync_file, read_jsonl, rewrite_jsonl
from rhymerl.config import ConfigError, RunConfig, load_config, minibatch_split, save_config
from rhymerl.data import PromptRow
from rhymerl.data.filters import filter_rows
from rhymerl.data.loader import PromptLoader
from rhymerl.data.splits import task_splits
from rhymerl.device import machine_info, resolve_device, resolve_dtype, torch_threads
from rhymerl.drafting import trains_draft_head, trains_eagle3
from rhymerl.engine import RequestOutput, SamplingParams
from rhymerl.model import load_pretrained
from rhymerl.progress import progress
from rhymerl.rewards import RewardCall, RewardPool, RewardSpec
from rhymerl.tokenizer import encode_prompt, load_tokenizer, tokenizer_fingerprint
from rhymerl.training.batch import GroupScore, KeptBatch, ScoredRollout
from rhymerl.training.checkpoint import (
    CheckpointError,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint_into,
    save_checkpoint,
)
from rhymerl.training.engine_checks import DrafterHealth, check_logp_gap, max_logp_gap
from rhymerl.training.evaluate import evaluate
from rhymerl.training.inputs import check_inputs, record_inputs, with_absolute_paths
from rhymerl.training.metrics import MetricsLogger, plot_run
from rhymerl.training.partial import CarriedGroup, merge, paused_samples, step_budget
from rhymerl.training.policy_versions import InFlight, PolicyVersions
from rhymerl.training.run_settings import continued_config, read_run_config
from rhymerl.training.sft import CARD, ensure_base_model, sft_output_dir
from rhymerl.training.step_metrics import StepFacts, StepTimes, async_metrics, engine_logp_gap, merge_counts, step_metrics
from rhymerl.training.summary import print_summary, summarize
from rhymerl.training.trainer import Experience, PolicyTrainer, Trainer

log = logging.getLogger(__name__)


def rollout_seed(seed: int, step: int, key: str) -> int:
    """The sampling seed of one prompt at one step: stable across processes and restarts."""
    return (zlib.crc32(f"{seed}:{step}:{key}".encode()) << 20 | step) & ((1 << 62) - 1)


def run_dir_for(cfg: RunConfig) -> Path:
    return Path(cfg.trainer.output_dir.format(task=cfg.data.task, seed=cfg.seed, engine=cfg.rollout.engine))


class RewardFunctionError(RuntimeError):
    """A reward function failed on every response of a step."""


@dataclass
class UpdateResult:
    """What a step's update phases produced: the trained responses' rewards and advantages,
    their seconds (old log-probs, the optimizer's work) and the update's own metrics."""

    rewards: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    advantages: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    old_s: float = 0.0
    update_s: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)


_SPEC_COUNTERS = ("forwards", "decode_rows", "accepted", "drafted", "draft_s", "generated")


class RLRun:
    """All state of one training run; ``run()`` executes it from its current step."""

    def __init__(self, cfg: RunConfig, run_dir: Path, *, progress: bool = True,
                 accept_changed_inputs: bool = False) -> None:
        self.run_dir, self.progress = run_dir, progress
        run_dir.mkdir(parents=True, exist_ok=True)
        resuming = latest_checkpoint(run_dir) is not None
        if not resuming:  # a run's record is written once, never on resume
            cfg = with_absolute_paths(cfg)
            save_config(cfg, run_dir / "config.yaml")
        self.cfg = cfg
        if resuming and not cfg.model.path and not (sft_output_dir(cfg) / CARD).exists() \
                and not accept_changed_inputs:  # never train a new base under a run's checkpoints
            raise ConfigError(f"{sft_output_dir(cfg)}: the run's base model is gone; restore it, or pass "
                              "--accept-changed-inputs to train a new one and continue anyway")
        base = ensure_base_model(cfg)
        if resuming:
            check_inputs(run_dir, cfg, base, accept_changes=accept_changed_inputs)
        else:
            record_inputs(run_dir, cfg, base)
        self.device = resolve_device(cfg.model.device)
        self.tokenizer = load_tokenizer(base)
        distributed = cfg.trainer.world_size > 1
        # Many ranks: this process keeps a CPU copy of the policy, which rank 0 publishes into
        # after each update; the rollout workers sync from it and checkpoints are written from it.
        on_cpu = self.device.type == "cpu" or distributed
        self.model = load_pretrained(base, device="cpu" if distributed else self.device,
                                     dtype=torch.float32 if on_cpu else resolve_dtype(cfg.model.dtype))
        self._load_data()
        sources = tuple(sorted({r.data_source for r in self.train_rows + self.val_rows}))
        self.reward_spec = RewardSpec(cfg.data.reward_file, cfg.data.reward_fn_name, sources)
        self.rewards = RewardPool(self.reward_spec, workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s)
        self.draft_head = None
        try:
            self.trainer: Trainer = self._build_trainer(base)
        except BaseException:
            self.rewards.close()  # no reward processes left behind by a run that cannot start
            raise
        self.sync_bytes = sum(p.numel() * 4 for p in self._named().values())  # float32 to the workers (head too)
        self.history = self._build_history()
        from rhymerl.distribution.factory import build_coordinator, trainer_threads_beside_workers

        engines_cfg = cfg
        if trains_eagle3(cfg.rollout.speculative):  # vLLM builds its drafter from a folder: the head as it starts
            head = self.draft_head.save(run_dir)
            engines_cfg = replace(cfg, rollout=replace(cfg.rollout,
                                                       speculative=cfg.rollout.speculative.with_(draft_model=str(head))))
        try:
            self.rollout = build_coordinator(engines_cfg, base, self._named(), tokenizer=self.tokenizer,
                                             history=self.history)
        except BaseException:
            self.rewards.close()  # no reward or trainer processes left behind either
            self.trainer.close()
            raise
        self.versions = PolicyVersions(cfg.trainer.async_staleness, self._named, self.rollout.pool.update_weights,
                                       wait_s=cfg.trainer.rollout_wait_s)
        self.metrics = MetricsLogger(run_dir)
        self.drafter_health = DrafterHealth()
        # An update overlapping the rollout (async RL, a streamed update) keeps, in this
        # process, to the cores the workers leave (a fixed count: its numbers never follow timing).
        overlaps = cfg.trainer.async_staleness or cfg.trainer.stream_update
        self.update_threads = trainer_threads_beside_workers(cfg) if overlaps and self.trainer.in_process else 0
        self.prompt_split = minibatch_split(cfg) == "prompts"  # the update starts on groups as they land
        self.step = 0
        self.initial_accuracy: dict[str, float] | None = None
        # held-out per-prompt scores (greedy, sampled) at the start and at the last evaluation
        self.initial_heldout: dict[str, list[float]] = {}
        self.last_heldout: dict[str, list[float]] = {}
        self.carried: list[CarriedGroup] = []  # paused groups waiting for the next step
        if cfg.rollout.carry_over_tokens > 0:
            log.warning("rollout.carry_over_tokens=%d: samples unfinished after that many tokens continue in "
                        "the next step under newer weights; those groups train off-policy",
                        cfg.rollout.carry_over_tokens)

    def _load_data(self) -> None:
        """The task's train and held-out rows, filtered to fit the model length, and the loader."""
        cfg = self.cfg
        train_rows, val_rows = task_splits(cfg.data, cfg.seed)
        fit = dict(max_model_len=cfg.rollout.max_model_len, min_response_tokens=cfg.data.min_response_tokens,
                   skip_bad_rows=cfg.data.skip_bad_rows)
        self.train_rows, dropped = filter_rows(train_rows, self.tokenizer, what="train", **fit)
        self.val_rows, val_dropped = filter_rows(val_rows, self.tokenizer, what="held-out", **fit) \
            if val_rows else ([], None)
        self.dropped_rows = {"data/dropped_overlong": len(dropped.overlong),
                             "data/dropped_unencodable": len(dropped.unencodable)}
        if val_dropped is not None:
            self.dropped_rows["data/val_dropped"] = len(val_dropped.overlong) + len(val_dropped.unencodable)
        self.loader = PromptLoader(self.train_rows, cfg.trainer.batch_prompts, cfg.seed)
        self._row_of = {row.key: row for row in self.train_rows}

    def _build_trainer(self, base: Path) -> Trainer:
        """N ranks (trainer.world_size > 1), or the update in this process (with a draft head
        trained online beside the policy, when the drafter has one)."""
        cfg = self.cfg
        total = cfg.trainer.steps * cfg.trainer.ppo_epochs * cfg.trainer.ppo_mini_batches
        if cfg.trainer.world_size > 1:
            from rhymerl.training.trainer_group import TrainerGroup

            return TrainerGroup(cfg, base, self.model, with_ref=cfg.algorithm.kl_coef > 0, total_optimizer_steps=total)
        ref = copy.deepcopy(self.model).eval().requires_grad_(False) if cfg.algorithm.kl_coef > 0 else None
        if trains_draft_head(cfg.rollout.speculative):
            from rhymerl.training.draft_head_trainer import DraftHeadTrainer

            self.draft_head = DraftHeadTrainer(self.model, cfg.rollout.speculative.draft_head_lr, self.device,
                                               seed=cfg.seed)
        elif trains_eagle3(cfg.rollout.speculative):
            from rhymerl.training.eagle3_trainer import Eagle3Trainer

            self.draft_head = Eagle3Trainer(self.model, base, cfg.rollout.speculative.draft_head_lr, self.device,
                                            seed=cfg.seed, steps=cfg.rollout.speculative.model_draft_tokens)
        return PolicyTrainer(self.model, cfg.trainer, cfg.algorithm, self.device, ref, total_optimizer_steps=total,
                             temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                             draft_head=self.draft_head, check_rollout_logp=cfg.rollout.engine != "native")

    def _build_history(self):
        """The controller's history store (None when neither drafting nor HistoPipe reads it):
        workers draft from the parts shipped with their work, HistoPipe predicts lengths from
        it, and it is saved with every checkpoint. The loop is its one writer."""
        spec = self.cfg.rollout.speculative
        if spec.method == "none" and self.cfg.rollout.schedule != "histopipe":
            return None
        from rhymerl.drafting import HistoryStore

        return HistoryStore(max_rollouts=max(1, spec.history_epochs),
                            tokenizer_fingerprint=tokenizer_fingerprint(self.tokenizer))

    # --- one step ------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, Any]:
        """One step, as named phases; returns its metrics."""
        t_step = time.perf_counter()
        batch, wait_s = self._collect(step)  # collect: this step's groups, generated and scored
        self._check_rewards(batch, step)  # a reward function that fails everywhere stops the run
        kept = self._filter(batch, step)  # DAPO's filter (and refills)
        self.carried = kept.carry
        epoch = self.loader.state.epoch  # the trained batch's (async draws the next one just below)
        if self.versions.asynchronous and step < self.cfg.trainer.steps:
            self._launch(step + 1)  # generates while this batch trains
        self.versions.keep_current(step)  # async: the weights a later batch may still be drawn by
        upd = self._update(batch, kept, step)  # advantages, then the update
        sync_bytes, sync_s = self._sync(step)  # the new weights into the workers
        times = StepTimes(gen=kept.gen_s, reward=kept.reward_s, old_logp=upd.old_s, update=upd.update_s,
                          sync=sync_s, step=time.perf_counter() - t_step,
                          wait_rollout=wait_s if self.versions.asynchronous else None)
        facts = StepFacts(scores=batch.scores, outs=batch.outs, rewards=upd.rewards, advantages=upd.advantages,
                          errors=kept.errors, timeouts=kept.timeouts, filtered=kept.filtered,
                          carried=len(self.carried), offpolicy_tokens=batch.offpolicy_tokens, epoch=epoch,
                          counts=merge_counts(batch.stats, kept.stats), extras=batch.extras,
                          predicted=batch.predicted, sync_bytes=sync_bytes, workers=self.rollout.num_workers)
        self._write_trace(step, batch, kept)
        m = {**upd.metrics, **step_metrics(facts, times)}
        if self.cfg.rollout.speculative.method != "none":
            m["spec/health"] = self.drafter_health.update(m["spec/accepted_per_forward"], step)
        return m

    def _collect(self, step: int) -> tuple[ScoredRollout, float]:
        """Step ``step``'s batch, and the seconds spent waiting for it: the one launched during
        the previous step (async), or generated now."""
        t = time.perf_counter()
        out = self.versions.take(step)
        if out is None:
            rows = self.loader.next_batch()
            version = self.versions.version_for(step)
            self.versions.push(version)
            out = self._rollout(rows, step, self.carried, version=version, split=self.prompt_split)
        return out, time.perf_counter() - t

    def _launch(self, step: int) -> None:
        """Start step ``step``'s rollout in the background (async RL)."""
        rows = self.loader.next_batch()
        self.versions.launch(step, self._rollout, rows, step, self.carried, self.versions.version_for(step))

    def settle(self) -> None:
        """Let the batch in flight finish (its result is kept)."""
        self.versions.settle()

    def _check_rewards(self, batch: ScoredRollout, step: int) -> None:
        """Broken, not unlucky: an import error or a typo fails every row, and training on
        all-zero rewards would look like a run that learns nothing."""
        scored_n = sum(len(g) for g in batch.scores)
        if scored_n and batch.errors + batch.timeouts == scored_n:
            raise RewardFunctionError(
                f"step {step}: the reward function {self._reward_fn_name(batch.rows[0].data_source)} failed on every "
                f"one of the step's {scored_n} responses ({batch.errors} raised, {batch.timeouts} timed out); "
                f"first: {batch.first_error}")

    def _filter(self, batch: ScoredRollout, step: int) -> KeptBatch:
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
            more = self._rollout(self.loader.next_batch(), step)  # synchronous only (config check)
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

    def _update(self, batch: ScoredRollout, kept: KeptBatch, step: int) -> UpdateResult:
        """Advantages, then the policy update: the prompt split's work already streamed on
        each group, or old log-probs, shaped rewards and advantages for the kept batch."""
        if batch.streamed is not None:
            return self._prompt_split_update(batch, kept.outs, step)
        prompts, responses, behaviour, scores, groups = kept.flat()
        if not responses:
            log.warning("step %d: every group had equal rewards; no update", step)
            return UpdateResult()
        # The engine's sampling log-probs: async RL corrects by them; on-policy, another engine's
        # are compared with the trainer's (a failed weight sync or a numerics gap shows there).
        on_policy_check = not self.versions.asynchronous and self.cfg.rollout.engine != "native"
        exp = Experience.build(prompts, responses, [0.0] * len(responses), self.tokenizer.pad_token_id or 0,
                               behaviour_logprobs=behaviour if self.versions.asynchronous or on_policy_check else None)
        sampled = exp.behav_logp if on_policy_check else None
        if on_policy_check:
            exp.behav_logp = None  # on-policy: no correction
        # Beside an async rollout, on the cores its worker leaves (update_threads; 0 keeps every core).
        with torch_threads(self.update_threads):
            res = self._advantages(exp, scores, [len(r) for r in responses], groups, batch.version, step)
            if sampled is not None:
                res.metrics.update(engine_logp_gap(exp.old_logp, sampled, exp.response_mask))
                check_logp_gap(res.metrics["rollout/logp_gap_max"],
                               max_logp_gap(self.cfg.rollout.max_logp_gap, self.cfg.model.dtype), step,
                               self.cfg.rollout.engine)
            t = time.perf_counter()
            res.metrics.update(self.trainer.update(exp, step, self.cfg.seed))
            res.update_s = time.perf_counter() - t
        return res

    def _advantages(self, exp: Experience, scores: list[float], lengths: list[int], groups: list[int],
                    drawn_by: int, step: int) -> UpdateResult:
        """Old (and reference) log-probs, rewards shaped by the algorithm, and advantages
        (written into ``exp``)."""
        cfg, algo = self.cfg, self.cfg.algorithm
        res = UpdateResult()
        t = time.perf_counter()
        self.trainer.compute_logps(exp)
        res.old_s = time.perf_counter() - t
        if self.versions.asynchronous:
            assert exp.old_logp is not None and exp.behav_logp is not None
            res.metrics.update(async_metrics(exp.old_logp, exp.behav_logp, exp.response_mask, step - 1 - drawn_by,
                                             algo.is_cap))
        res.rewards, seq_kl = shaped_rewards(torch.tensor(scores, dtype=torch.float32), torch.tensor(lengths), algo,
                                             cfg.rollout.max_tokens, exp.old_logp, exp.ref_logp, exp.response_mask)
        if seq_kl is not None:
            res.metrics["critic/kl_in_reward"] = float(seq_kl.mean())
        res.advantages = ADV_ESTIMATORS[algo.adv_estimator](res.rewards, torch.tensor(groups),
                                                            norm_by_std=algo.norm_adv_by_std)
        exp.advantages = res.advantages.float()
        return res

    def _prompt_split_update(self, batch: ScoredRollout, kept_outs: list[RequestOutput], step: int) -> UpdateResult:
        """The update of a prompt-split step: the work already done on each group as it landed
        (streamed) is finished, then the optimizer steps."""
        from rhymerl.training.stream import stream_update

        streamed, cfg = batch.streamed, self.cfg
        res = UpdateResult()
        t = time.perf_counter()
        streamed.finish()
        res.old_s = time.perf_counter() - t
        slot_of = {id(o): i for i, o in enumerate(batch.outs)}
        slots = [slot_of[id(o)] for o in kept_outs]
        t = time.perf_counter()
        res.metrics.update(stream_update(self.trainer, streamed, slots, step, cfg.seed, cfg.trainer.ppo_mini_batches,
                                         cfg.trainer.ppo_epochs))
        res.update_s = time.perf_counter() - t
        groups = [streamed.groups[s] for s in slots]
        if groups:
            res.rewards = torch.cat([g.reward for g in groups])
            res.advantages = torch.cat([g.exp.advantages for g in groups])
            if cfg.algorithm.use_kl_in_reward:
                res.metrics["critic/kl_in_reward"] = sum(g.kl_in_reward for g in groups) / len(res.rewards)
        else:
            log.warning("step %d: every group had equal rewards; no update", step)
        res.metrics["timing_s/streamed"] = streamed.busy_s  # work on groups, hidden in the rollout or not
        return res

    def _sync(self, step: int) -> tuple[int, float]:
        """The update's weights into the controller's copy (from trainer ranks) and, in a
        synchronous run, into the rollout workers; returns the bytes moved and the seconds."""
        t = time.perf_counter()
        sync_bytes = self.trainer.publish().bytes
        self.versions.updated(step)
        if not self.versions.asynchronous:
            sync_bytes += self.sync_bytes
        return sync_bytes, time.perf_counter() - t

    def _write_trace(self, step: int, batch: ScoredRollout, kept: KeptBatch) -> None:
        """Per-sample lengths of the step's groups: what `bench pipe` replays."""
        trained = {id(o) for o in kept.outs}
        with open(self.run_dir / "traces.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "keys": [row.key for row in batch.rows], "predicted": batch.predicted,
                                "prompt_lens": [len(o.prompt_token_ids) for o in batch.outs],
                                "lengths": [[len(c.token_ids) for c in o.outputs] for o in batch.outs],
                                "forwards": [[c.num_forwards for c in o.outputs] for o in batch.outs],
                                # which groups the update trained on (DAPO's filter drops the rest)
                                "trained": [id(o) in trained for o in batch.outs],
                                "gen_s": kept.gen_s}) + "\n")

    # --- generation and scoring ----------------------------------------------------------------
    def _rollout(self, rows: list[PromptRow], step: int, carried: list[CarriedGroup] | None = None,
                 version: int | None = None, split: bool = False) -> ScoredRollout:
        """Generate for ``rows`` (after the ``carried`` groups, continued from their pause) and
        score each prompt as soon as its samples are all back. Groups paused at this step's
        token budget come back in ``carry``, unscored. ``split``: the prompt split's update work
        starts on each group as it is scored (in the background with ``stream_update``)."""
        from rhymerl.distribution import RolloutRequest

        r = self.cfg.rollout
        carried = carried or []
        budget = r.carry_over_tokens
        all_rows = [self._row_of[g.key] for g in carried] + rows

        def params(prefix_len: int) -> SamplingParams:
            return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                  max_tokens=step_budget(r.max_tokens, budget, prefix_len),
                                  # a paused sample's prefix carries its log-probs; async RL
                                  # corrects by the sampling policy's
                                  logprobs=budget > 0 or self.versions.asynchronous)

        reqs = [RolloutRequest(encode_prompt(self.tokenizer, row.prompt), params(g.prefix_len()), g.seed, g.key,
                               samples=tuple(sorted(g.paused)), prefixes=dict(g.paused))
                for g, row in zip(carried, all_rows)]
        reqs += [RolloutRequest(encode_prompt(self.tokenizer, row.prompt), params(0),
                                rollout_seed(self.cfg.seed, step, row.key), row.key)
                 for row in rows]
        limits = [min(r.max_tokens, r.max_model_len - len(q.prompt_ids)) for q in reqs]
        predicted = self._predict(all_rows)  # before this step's lengths join the history
        streamed = self._streamed(step, predicted) if split else None
        scored: dict[int, GroupScore] = {}
        whole: dict[int, RequestOutput] = {}
        reward_s = 0.0

        def on_done(i: int, out) -> None:
            nonlocal reward_s
            if i < len(carried):
                out = merge(carried[i], out)
            whole[i] = out
            if budget and not out.error and paused_samples(out, limits[i]):
                return  # paused: scored when the group is whole
            t = time.perf_counter()
            scored[i] = self._score(all_rows[i], out)
            reward_s += time.perf_counter() - t
            if streamed is not None:
                g = scored[i].scores
                trains = not self.cfg.algorithm.dynamic_sampling or informative(g)
                streamed.add(i, out.prompt_token_ids if trains else None, [c.token_ids for c in out.outputs], g)

        st, pipe = self.rollout.stats, self.rollout.pipe
        s0 = {k: getattr(st, k) for k in _SPEC_COUNTERS}
        src0 = dict(self.rollout.source_stats)
        p0 = vars(pipe).copy()
        t = time.perf_counter()
        self.rollout.rollout(reqs, step, on_done=on_done)  # on_done sees every request
        gen_s = time.perf_counter() - t - reward_s
        carry: list[CarriedGroup] = []
        done = [i for i in range(len(reqs)) if i in scored]
        offpolicy = 0
        for i in range(len(reqs)):
            out = whole[i]
            if i not in scored:
                paused = {c.index: (list(c.token_ids), list(c.logprobs or [])) for c in paused_samples(out, limits[i])}
                since = carried[i].since_step if i < len(carried) else step
                carry.append(CarriedGroup(all_rows[i].key, reqs[i].seed, since,
                                          [c for c in out.outputs if c.index not in paused], paused))
            else:
                if i < len(carried):
                    offpolicy += carried[i].offpolicy_tokens()
                if self.history is not None and out.error is None:
                    # The history's one writer: each group once it is whole and scored, with its rewards.
                    self.history.add(all_rows[i].key, reqs[i].prompt_ids, [c.token_ids for c in out.outputs], step,
                                     scored[i].scores)
        extras: dict[str, list[float]] = {}
        for i in done:
            for k, v in scored[i].extras.items():
                extras.setdefault(k, []).extend(v)
        return ScoredRollout([all_rows[i] for i in done], [whole[i] for i in done], [scored[i].scores for i in done],
                             sum(scored[i].errors for i in done), sum(scored[i].timeouts for i in done),
                             next((scored[i].first_error for i in done if scored[i].first_error), None),
                             extras, [predicted[i] for i in done],
                             gen_s=gen_s, reward_s=reward_s, carry=carry, offpolicy_tokens=offpolicy,
                             version=self.versions.current if version is None else version, streamed=streamed,
                             stats={**{k: getattr(st, k) - s0[k] for k in _SPEC_COUNTERS},
                                    **{f"src/{k}": v - src0.get(k, 0) for k, v in self.rollout.source_stats.items()},
                                    **{f"pipe/{k}": v - p0[k] for k, v in vars(pipe).items()}})

    def _streamed(self, step: int, predicted: list[float | None]):
        """The prompt split's update work for step ``step``'s groups (streamed or after)."""
        from rhymerl.training.stream import StreamedUpdate, processing_order, prompt_minibatches

        cfg, P = self.cfg, len(predicted)
        first = prompt_minibatches(P, cfg.trainer.ppo_mini_batches, cfg.seed, step, 0)[0]
        return StreamedUpdate(self.trainer, cfg, self.tokenizer.pad_token_id or 0,
                              processing_order(predicted, P, cfg.seed, step), set(first),
                              background=cfg.trainer.stream_update,
                              threads=self.update_threads if cfg.trainer.stream_update else 0)

    def _predict(self, rows: list[PromptRow]) -> list[float | None]:
        """HistoPipe's length prediction per prompt (None without history), for the trace."""
        if self.history is None:
            return [None] * len(rows)
        from rhymerl.scheduling import predict_lengths

        hist = [self.history.lengths(row.key) for row in rows]
        pred = predict_lengths(hist, self.cfg.rollout.length_stat)
        return [float(p) if h else None for p, h in zip(pred, hist)]

    def _score(self, row: PromptRow, out: RequestOutput) -> GroupScore:
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

    def _named(self) -> dict[str, torch.Tensor]:
        """What the rollout workers receive: the policy's weights, and an online draft head's
        (so it is never stale after a sync)."""
        named = dict(self.model.named_parameters())
        if self.draft_head is not None:
            named.update(self.draft_head.named())
        return named

    # --- resume ----------------------------------------------------------------------------
    def resume(self) -> bool:
        """Continue from the newest checkpoint that loads; a damaged one is skipped with a
        warning (it is never used half-way), and all of them damaged is an error."""
        ckpts = complete_checkpoints(self.run_dir)
        if not ckpts:
            # Killed before its first checkpoint: it starts over, so what it logged goes too.
            self.step = 0
            self._truncate_logs()
            return False
        failures = []
        for ckpt in reversed(ckpts):
            try:
                gate = self._restore(ckpt)
                self._after_restore(gate)
                print(f"resumed {self.run_dir} from {ckpt.name}")
                break
            except CheckpointError as e:
                log.warning("%s; trying an older checkpoint", e)
                failures.append(str(e))
        else:
            raise CheckpointError(f"{self.run_dir}: no checkpoint could be restored: " + "; ".join(failures))
        return True

    def _restore(self, ckpt: Path) -> list:
        """Load ``ckpt`` into the run; returns the workers' saved gate states."""
        state = load_checkpoint_into(ckpt, self.model, self.trainer.load_state,
                                     device=next(self.model.parameters()).device,
                                     dtype=next(self.model.parameters()).dtype)
        try:
            self.loader.load_state_dict(state["loader"])
            carried = [CarriedGroup.from_dict(d) for d in state.get("carried", [])]
            bad_steps = int(state.get("bad_steps", 0))
            inflight = state.get("inflight")
            inflight = None if inflight is None else InFlight(
                int(inflight["step"]), ScoredRollout.from_dict(inflight["rollout"], self._row_of))
            snapshots = {}
            if (ckpt / "snapshots.pt").exists():
                snapshots = {int(v): named for v, named in
                             torch.load(ckpt / "snapshots.pt", weights_only=True).items()}
            initial = state.get("initial_accuracy")
            if initial is not None and not (isinstance(initial, dict) and all(
                    isinstance(v, (int, float)) for v in initial.values())):
                raise ValueError(f"initial_accuracy {initial!r} is not a mapping of numbers")
            initial_heldout = state.get("initial_heldout", {})
            if not isinstance(initial_heldout, dict) or not all(isinstance(v, list) for v in initial_heldout.values()):
                raise ValueError(f"initial_heldout {initial_heldout!r} is not a mapping of lists")
            initial_heldout = {str(k): [float(x) for x in v] for k, v in initial_heldout.items()}
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{ckpt / 'state.json'}: malformed ({type(e).__name__}: {e})") from e
        self.step = state["step"]
        self.initial_accuracy = initial
        self.initial_heldout = initial_heldout
        self.trainer.bad_steps = bad_steps
        self.carried = carried
        self.versions.restore(self.step, snapshots, inflight)
        gate = state.get("gate")
        if self.history is not None:
            from rhymerl.drafting import HistoryStore

            # A missing or damaged store is discarded inside load (history only accelerates).
            loaded = HistoryStore.load(ckpt / "history.json.gz",
                                       tokenizer_fingerprint=tokenizer_fingerprint(self.tokenizer),
                                       vocab_size=self.model.config.vocab_size)
            self.history.replace_with(loaded)
        return gate if isinstance(gate, list) else []

    def _after_restore(self, gate: list) -> None:
        self.versions.resync()
        self.rollout.pool.load_gate_states(gate)  # the workers' gates continue where they were
        self._truncate_logs()

    def _truncate_logs(self) -> None:
        """Drop logged steps after ``self.step`` (they will be redone); with no checkpoint,
        every line, the initial evaluation's included."""
        last = self.step if self.step > 0 else -1
        self.metrics.truncate_after(last)
        traces = self.run_dir / "traces.jsonl"
        if traces.exists():
            rewrite_jsonl(traces, [t for t in read_jsonl(traces) if t.get("step", 0) <= last])

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy: greedy, and avg@4 at the rollout temperature (what RL optimises)."""
        r = self.cfg.rollout
        greedy = evaluate(self.rollout, self.val_rows, self.rewards, max_tokens=r.max_tokens)
        out = {"val/accuracy": greedy.accuracy}
        self.last_heldout = {"greedy": greedy.per_prompt}
        if r.temperature > 0:
            sampled = evaluate(self.rollout, self.val_rows, self.rewards, max_tokens=r.max_tokens,
                               temperature=r.temperature, n=4, seed=self.cfg.seed + 7)
            out["val/accuracy_sampled"] = sampled.accuracy
            self.last_heldout["sampled"] = sampled.per_prompt
        return out

    # --- the run ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        try:
            return self._run()
        finally:
            self.close()

    def _save_trainer_state(self, folder: Path) -> None:
        self.trainer.save_state(folder)
        self.versions.save_snapshots(folder / "snapshots.pt")  # async: older versions later batches are drawn by

    def close(self) -> None:
        """Stop the rollout workers, the reward processes and any trainer ranks (idempotent)."""
        self.versions.close(timeout=600)
        self.rollout.pool.close()
        self.rewards.close()
        self.trainer.close()

    def _reward_fn_name(self, data_source: str) -> str:
        spec = self.reward_spec
        if spec.reward_file and data_source in spec.sources:
            return spec.user_fn_name()
        return f"for data_source {data_source!r}"

    def _checkpoint(self, step: int) -> None:
        """Everything a resumed run needs to continue exactly. Async: the batch in flight is
        saved whole, so a resumed run trains on exactly it."""
        cfg = self.cfg
        self.settle()
        for log_file in ("metrics.jsonl", "traces.jsonl"):  # what the checkpoint's steps logged, on disk first
            if (self.run_dir / log_file).exists():
                fsync_file(self.run_dir / log_file)
        save_checkpoint(self.run_dir, step, self.model, self.tokenizer, self._save_trainer_state,
                        {"loader": self.loader.state_dict(), "initial_accuracy": self.initial_accuracy,
                         "initial_heldout": self.initial_heldout,
                         "world_size": cfg.trainer.world_size, "strategy": cfg.trainer.strategy,
                         "inflight": self.versions.inflight_state(),
                         "bad_steps": self.trainer.bad_steps,
                         "carried": [g.to_dict() for g in self.carried],
                         "gate": self.rollout.pool.gate_states()},
                        self.history)

    def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        t0 = time.perf_counter()
        if self.initial_accuracy is None and self.val_rows:
            self.initial_accuracy = self.evaluate()
            self.initial_heldout = dict(self.last_heldout)
            self.metrics.log(0, {**self.initial_accuracy, **self.dropped_rows})
        last_val = float("nan")
        bar = progress(range(self.step + 1, cfg.trainer.steps + 1), desc="rl", enabled=self.progress,
                       initial=self.step, total=cfg.trainer.steps)
        for step in bar:
            m = self.train_step(step)
            if self.val_rows and (_every(step, cfg.trainer.eval_every) or step == cfg.trainer.steps):
                self.settle()  # the workers finish the batch in flight, then evaluate this step's policy
                self.versions.push(self.versions.current)
                m.update(self.evaluate())
                last_val = m["val/accuracy"]
            self.metrics.log(step, m)
            self.step = step
            bar.set_postfix(reward=f"{m['critic/score/mean']:.2f}", gen=f"{m['timing_s/gen']:.1f}s",
                            acc_fwd=f"{m['spec/accepted_per_forward']:.2f}",
                            val=f"{last_val:.2f}")
            if _every(step, cfg.trainer.save_every) or step == cfg.trainer.steps:
                self._checkpoint(step)
        bar.close()
        self.metrics.close()
        plots = plot_run(self.run_dir)
        summary = summarize(self.run_dir, time.perf_counter() - t0, (self.initial_heldout, self.last_heldout))
        summary["plots"] = [str(p) for p in plots]
        summary["machine"] = machine_info()  # exactness holds per CPU model, torch build and threads
        atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary


def _every(step: int, period: int) -> bool:
    """Whether a periodic action falls on ``step`` (period <= 0: never; the last step still does)."""
    return period > 0 and step % period == 0


def load_run_config(run_dir: Path, overrides: list[str] | None = None) -> RunConfig:
    """A run folder's own config, with the ``key=value`` changes a later session may make
    (:mod:`.run_settings`: placement keys, a raised ``trainer.steps``); any other is refused."""
    own = read_run_config(run_dir)
    wanted = load_config(run_dir / "config.yaml", overrides) if overrides else own
    return continued_config(run_dir, wanted, _checkpoint_step(run_dir), how="--resume")


def _checkpoint_step(run_dir: Path) -> int:
    ckpt = latest_checkpoint(run_dir)
    return int(ckpt.name.removeprefix("step_")) if ckpt is not None else 0


def train(cfg: RunConfig | None = None, *, resume: str | None = None, config_path: str | None = None,
          progress: bool = True, resume_overrides: list[str] | None = None, accept_changed_inputs: bool = False) -> int:
    if resume:
        run_dir = Path(resume)
        cfg = load_run_config(run_dir, resume_overrides)
    else:
        cfg = cfg or load_config()
        run_dir = run_dir_for(cfg)
        if latest_checkpoint(run_dir) is not None:
            cfg = continued_config(run_dir, with_absolute_paths(cfg), _checkpoint_step(run_dir),
                                   how="it already has checkpoints")
            print(f"{run_dir} already has checkpoints: continuing it (use another trainer.output_dir to start anew)")
    run = RLRun(cfg, run_dir, progress=progress, accept_changed_inputs=accept_changed_inputs)
    try:
        run.resume()
    except BaseException:
        run.close()  # no reward, rollout or rank processes left behind by a resume that failed
        raise
    summary = run.run()
    print_summary(summary, run_dir)
    return 0
