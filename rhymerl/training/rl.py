"""The main job: ``rhymerl train``.

One step reads top to bottom as named phases (:meth:`RLRun.train_step`):

    collect -> check rewards -> filter -> advantages -> update -> sync -> metrics and trace

Synchronous (``trainer.async_staleness=0``): each step generates with the weights it trains
(rollout seeded per step and prompt key), so every response of step t comes from the weights
of step t. Async (S >= 1): :class:`~rhymerl.training.rollout.policy_versions.PolicyVersions` decides
which version draws each batch. Metrics are pure functions (:mod:`rhymerl.training.metrics.step`).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from rhymerl.atomic_io import fsync_file
from rhymerl.config import RunConfig, load_config, minibatch_split
from rhymerl.device import resolve_device, torch_threads
from rhymerl.progress import progress
from rhymerl.rollout_engines import get_engine
from rhymerl.tokenizer import load_tokenizer
from rhymerl.training.checkpoint import (
    CheckpointError,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint_into,
    save_checkpoint,
)
from rhymerl.training.metrics import (
    MetricsLogger,
    StepFacts,
    StepTimes,
    append_trace,
    evaluate,
    merge_counts,
    plot_run,
    print_summary,
    step_metrics,
    summarize,
    truncate_trace,
    write_summary,
)
from rhymerl.training.rollout import (
    CarriedGroup,
    DrafterHealth,
    KeptBatch,
    PolicyVersions,
    RolloutPhase,
    ScoredRollout,
    UpdateResult,
    check_logp_gap,
    checked_responses,
    logp_gap,
    max_logp_gap,
)
from rhymerl.training.run import (
    build_history,
    build_rewards,
    build_rollout,
    build_trainer,
    continued_config,
    load_data,
    load_policy,
    pinned_inputs,
    read_run_config,
    read_run_state,
    restore_history,
    update_threads,
    with_absolute_paths,
)
from rhymerl.training.sft import read_card, short_base
from rhymerl.training.update import (
    Experience,
    advantages,
    finish_prompt_split,
    sampling_token_logp,
    streamed_update_for,
)

log = logging.getLogger(__name__)


def run_dir_for(cfg: RunConfig) -> Path:
    return Path(cfg.trainer.output_dir.format(task=cfg.data.task, seed=cfg.seed, engine=cfg.rollout.engine))


class RLRun:
    """All state of one training run; ``run()`` executes it from its current step. Its parts are
    built by the run room (:mod:`rhymerl.training.run`), a step's collect phase is the rollout room's
    :class:`~rhymerl.training.rollout.RolloutPhase`, the update is the update room's."""

    def __init__(self, cfg: RunConfig, run_dir: Path, *, progress: bool = True,
                 accept_changed_inputs: bool = False) -> None:
        self.run_dir, self.progress = run_dir, progress
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg, base = pinned_inputs(cfg, run_dir, latest_checkpoint(run_dir) is not None, accept_changed_inputs)
        self.cfg, self.base = cfg, base
        self.device = resolve_device(cfg.model.device)
        self.tokenizer = load_tokenizer(base)
        self.model = load_policy(cfg, base, self.device)
        self.data = load_data(cfg, self.tokenizer)
        self.reward_spec, self.rewards = build_rewards(cfg, self.data)
        try:
            self.trainer, self.draft_head = build_trainer(cfg, base, self.model, self.device)
        except BaseException:
            self.rewards.close()  # no reward processes left behind by a run that cannot start
            raise
        self.sync_bytes = sum(p.numel() * 4 for p in self._named().values())  # float32 to the workers (head too)
        self.history = build_history(cfg, self.tokenizer)
        try:
            self.rollout = build_rollout(cfg, self.draft_head, run_dir, base, self._named(), self.tokenizer,
                                         self.history)
        except BaseException:
            self.rewards.close()  # no reward or trainer processes left behind either
            self.trainer.close()
            raise
        self.versions = PolicyVersions(cfg.trainer.async_staleness, self._named, self.rollout.pool.update_weights,
                                       wait_s=cfg.trainer.rollout_wait_s)
        self.rollout_phase = RolloutPhase(cfg, self.tokenizer, self.rollout, self.history, self.rewards,
                                          self.reward_spec, self.versions, self.data.row_of, self._streamed)
        self.metrics = MetricsLogger(run_dir)
        self.trainer_temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.drafter_health = DrafterHealth()
        self.update_threads = update_threads(cfg, self.trainer)  # an update beside the rollout: the cores left
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

    # --- one step ------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, Any]:
        """One step, as named phases; returns its metrics."""
        t_step = time.perf_counter()
        batch, wait_s = self._collect(step)  # collect: this step's groups, generated and scored
        self.rollout_phase.check_rewards(batch, step)  # a reward function that fails everywhere stops the run
        gap = self._check_engine(batch, step)  # another engine's log-probs against the drawing weights'
        kept = self.rollout_phase.filter(batch, step, self.data.loader.next_batch)  # DAPO's filter (and refills)
        self.carried = kept.carry
        epoch = self.data.loader.state.epoch  # the trained batch's (async draws the next one just below)
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
        append_trace(self.run_dir / "traces.jsonl", step, batch, kept)
        m = {**upd.metrics, **gap, **step_metrics(facts, times)}
        if self.cfg.rollout.speculative.method != "none":
            m["spec/health"] = self.drafter_health.update(m["spec/accepted_per_forward"], step)
        return m

    def _collect(self, step: int) -> tuple[ScoredRollout, float]:
        """Step ``step``'s batch, and the seconds spent waiting for it: the one launched during
        the previous step (async), or generated now."""
        t = time.perf_counter()
        out = self.versions.take(step)
        if out is None:
            rows = self.data.loader.next_batch()
            version = self.versions.version_for(step)
            self.versions.push(version)
            out = self.rollout_phase.run(rows, step, self.carried, version=version, split=self.prompt_split)
        return out, time.perf_counter() - t

    def _launch(self, step: int) -> None:
        """Start step ``step``'s rollout in the background (async RL)."""
        rows = self.data.loader.next_batch()
        self.versions.launch(step, self.rollout_phase.run, rows, step, self.carried, self.versions.version_for(step))

    def settle(self) -> None:
        """Let the batch in flight finish (its result is kept)."""
        self.versions.settle()

    def _update(self, batch: ScoredRollout, kept: KeptBatch, step: int) -> UpdateResult:
        """Advantages, then the policy update: the prompt split's work already streamed on
        each group, or old log-probs, shaped rewards and advantages for the kept batch."""
        if batch.streamed is not None:
            return finish_prompt_split(self.trainer, batch, kept.outs, step, self.cfg)
        prompts, responses, behaviour, scores, groups = kept.flat()
        if not responses:
            log.warning("step %d: every group had equal rewards; no update", step)
            return UpdateResult()
        # Async RL corrects by the engine's sampling log-probs (the policy that drew the tokens).
        exp = Experience.build(prompts, responses, [0.0] * len(responses), self.tokenizer.pad_token_id or 0,
                               behaviour_logprobs=behaviour if self.versions.asynchronous else None)
        # Beside an async rollout, on the cores its worker leaves (update_threads; 0 keeps every core).
        with torch_threads(self.update_threads):
            res = advantages(self.trainer, self.cfg, exp, scores, [len(r) for r in responses], groups,
                             step - 1 - batch.version if self.versions.asynchronous else None)
            t = time.perf_counter()
            res.metrics.update(self.trainer.update(exp, step, self.cfg.seed))
            res.update_s = time.perf_counter() - t
        return res

    def _check_engine(self, batch: ScoredRollout, step: int) -> dict[str, float]:
        """An engine other than ours: its sampling log-probs on a spread of the step's responses
        (filtered groups included; groups continued from earlier steps' weights left out) against
        the trainer's under the weights that drew them (async: that version's copy). Every path
        (synchronous, streamed, prompt split, async) comes through here before its update."""
        if get_engine(self.cfg.rollout.engine).exact_logprobs:
            return {}
        rows = [(o.prompt_token_ids, c.token_ids, c.logprobs or []) for o in batch.outs[batch.continued:]
                for c in o.outputs]
        pick = [rows[i] for i in checked_responses(len(rows))]
        weights = self.versions.weights_of(batch.version)
        model = self.model
        if weights is not None:  # an older version: its kept copy, in place of the live parameters
            own = dict(model.named_parameters())
            weights = {n: w for n, w in weights.items() if n in own}
        t = self.trainer_temperature

        def token_logp(ids: torch.Tensor) -> torch.Tensor:
            out = torch.func.functional_call(model, weights, (ids,)) if weights is not None else model(ids)
            return sampling_token_logp(out, ids, t, self.cfg.rollout.top_p, self.cfg.rollout.top_k)[0]

        with torch_threads(self.update_threads):
            gap = logp_gap(token_logp, [p for p, _, _ in pick], [r for _, r, _ in pick], [lp for _, _, lp in pick],
                           self.tokenizer.pad_token_id or 0, self.device)
        check_logp_gap(gap["rollout/logp_gap_max"], max_logp_gap(self.cfg.rollout.max_logp_gap, self.cfg.model.dtype),
                       step, self.cfg.rollout.engine)
        return gap

    def _sync(self, step: int) -> tuple[int, float]:
        """The update's weights into the controller's copy (from trainer ranks) and, in a
        synchronous run, into the rollout workers; returns the bytes moved and the seconds."""
        t = time.perf_counter()
        sync_bytes = self.trainer.publish().bytes
        self.versions.updated(step)
        if not self.versions.asynchronous:
            sync_bytes += self.sync_bytes
        return sync_bytes, time.perf_counter() - t

    def _streamed(self, step: int, predicted: list[float | None]):
        """The prompt split's update work for step ``step``'s groups (streamed or after)."""
        return streamed_update_for(self.trainer, self.cfg, self.tokenizer.pad_token_id or 0, step, predicted,
                                   self.update_threads)

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
        rs = read_run_state(ckpt, state, self.data.row_of)
        try:
            self.data.loader.load_state_dict(rs.loader)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{ckpt / 'state.json'}: malformed loader ({type(e).__name__}: {e})") from e
        self.step = rs.step
        self.initial_accuracy, self.initial_heldout = rs.initial_accuracy, rs.initial_heldout
        self.trainer.bad_steps = rs.bad_steps
        self.carried = rs.carried
        self.versions.restore(self.step, rs.snapshots, rs.inflight)
        if self.history is not None:
            restore_history(self.history, ckpt, self.tokenizer, self.model.config.vocab_size)
        self.rollout.load_placement_state(rs.placement)  # HistoPipe's auto continues where it was
        return rs.gate

    def _after_restore(self, gate: list) -> None:
        self.versions.resync()
        self.rollout.pool.load_gate_states(gate)  # the workers' gates continue where they were
        self._truncate_logs()

    def _truncate_logs(self) -> None:
        """Drop logged steps after ``self.step`` (they will be redone); with no checkpoint,
        every line, the initial evaluation's included."""
        last = self.step if self.step > 0 else -1
        self.metrics.truncate_after(last)
        truncate_trace(self.run_dir / "traces.jsonl", last)

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy: greedy, and avg@4 at the rollout temperature (what RL optimises)."""
        r = self.cfg.rollout
        greedy = evaluate(self.rollout, self.data.val_rows, self.rewards, max_tokens=r.max_tokens)
        out = {"val/accuracy": greedy.accuracy}
        self.last_heldout = {"greedy": greedy.per_prompt}
        if r.temperature > 0:
            sampled = evaluate(self.rollout, self.data.val_rows, self.rewards, max_tokens=r.max_tokens,
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

    def _checkpoint(self, step: int) -> None:
        """Everything a resumed run needs to continue exactly. Async: the batch in flight is
        saved whole, so a resumed run trains on exactly it."""
        cfg = self.cfg
        self.settle()
        for log_file in ("metrics.jsonl", "traces.jsonl"):  # what the checkpoint's steps logged, on disk first
            if (self.run_dir / log_file).exists():
                fsync_file(self.run_dir / log_file)
        save_checkpoint(self.run_dir, step, self.model, self.tokenizer, self._save_trainer_state,
                        {"loader": self.data.loader.state_dict(), "initial_accuracy": self.initial_accuracy,
                         "initial_heldout": self.initial_heldout,
                         "world_size": cfg.trainer.world_size, "strategy": cfg.trainer.strategy,
                         "inflight": self.versions.inflight_state(),
                         "bad_steps": self.trainer.bad_steps,
                         "carried": [g.to_dict() for g in self.carried],
                         "gate": self.rollout.pool.gate_states(),
                         "placement": self.rollout.placement_state()},
                        self.history)

    def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        t0 = time.perf_counter()
        if self.initial_accuracy is None and self.data.val_rows:
            self.initial_accuracy = self.evaluate()
            self.initial_heldout = dict(self.last_heldout)
            self.metrics.log(0, {**self.initial_accuracy, **self.data.dropped_rows})
        last_val = float("nan")
        bar = progress(range(self.step + 1, cfg.trainer.steps + 1), desc="rl", enabled=self.progress,
                       initial=self.step, total=cfg.trainer.steps)
        for step in bar:
            m = self.train_step(step)
            if self.data.val_rows and (_every(step, cfg.trainer.eval_every) or step == cfg.trainer.steps):
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
        card = read_card(self.base)
        if card is not None and short_base(card):
            summary["base_short"] = short_base(card)  # said at the end too: the run learnt from a short base
        write_summary(self.run_dir, summary)
        return summary


def _every(step: int, period: int) -> bool:
    """Whether a periodic action falls on ``step`` (period <= 0: never; the last step still does)."""
    return period > 0 and step % period == 0


def load_run_config(run_dir: Path, overrides: list[str] | None = None) -> RunConfig:
    """A run folder's own config, with the ``key=value`` changes a later session may make
    (:mod:`rhymerl.training.run.settings`: placement keys, a raised ``trainer.steps``); any other is refused."""
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
