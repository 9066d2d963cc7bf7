"""The main job: ``rhymerl train``. One synchronous, on-policy step:

rollout (n responses per prompt, seeded per step and prompt key) -> rewards -> advantages
-> old log-probs -> policy update -> weight sync into the engine -> history update.
Every response of step t comes from the weights of step t.
"""
from __future__ import annotations

import copy
import json
import logging
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm.auto import tqdm

from rhymerl.atomic_io import atomic_write_text, read_jsonl, rewrite_jsonl
from rhymerl.config import ConfigError, RunConfig, load_config, minibatch_split, save_config
from rhymerl.drafting import trains_draft_head
from rhymerl.data import PromptRow
from rhymerl.data.filters import filter_rows
from rhymerl.data.loader import PromptLoader
from rhymerl.data.splits import task_splits
from rhymerl.device import machine_info, resolve_device, resolve_dtype, torch_threads
from rhymerl.engine import RequestOutput, SamplingParams
from rhymerl.engine.outputs import CompletionOutput
from rhymerl.model import load_pretrained
from rhymerl.rewards import RewardCall, RewardPool, RewardSpec
from rhymerl.tokenizer import encode_prompt, load_tokenizer, tokenizer_fingerprint
from rhymerl.training.algos import ADV_ESTIMATORS, informative, shaped_rewards
from rhymerl.training.checkpoint import (
    CheckpointError,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint_into,
    save_checkpoint,
)
from rhymerl.training.evaluate import evaluate
from rhymerl.training.metrics import MetricsLogger, plot_run, read_metrics
from rhymerl.training.partial import CarriedGroup, merge, paused_samples, step_budget
from rhymerl.training.sft import CARD, print_card, run_sft, sft_output_dir
from rhymerl.training.trainer import Experience, PolicyTrainer

if TYPE_CHECKING:
    from rhymerl.training.trainer_group import TrainerGroup

log = logging.getLogger(__name__)


def ensure_base_model(cfg: RunConfig) -> Path:
    """The policy to start from: ``model.path``, or the task's SFT base (trained if missing)."""
    if cfg.model.path:
        return Path(cfg.model.path)
    out = sft_output_dir(cfg)
    card_path = out / CARD
    if card_path.exists():
        card = json.loads(card_path.read_text())
        print(f"base model: reusing {out} (held-out greedy accuracy "
              f"{100 * card['heldout_greedy_accuracy']:.1f}%)")
        return out
    print(f"base model: none at {out}; training it from scratch (rhymerl sft)")
    print_card(run_sft(cfg, out), out)
    return out


def ensure_draft_model(cfg: RunConfig) -> Path:
    """The task's small draft model (``rhymerl sft --draft``), trained if missing."""
    from rhymerl.training.sft import draft_config

    d = draft_config(cfg)
    d.model.path = None
    return ensure_base_model(d)


def rollout_seed(seed: int, step: int, key: str) -> int:
    """The sampling seed of one prompt at one step: stable across processes and restarts."""
    return (zlib.crc32(f"{seed}:{step}:{key}".encode()) << 20 | step) & ((1 << 62) - 1)


def run_dir_for(cfg: RunConfig) -> Path:
    return Path(cfg.trainer.output_dir.format(task=cfg.data.task, seed=cfg.seed))


class RewardFunctionError(RuntimeError):
    """A reward function failed on every response of a step."""


@dataclass
class GroupScore:
    """One prompt's responses scored."""

    scores: list[float]
    errors: int  # calls that raised (scored 0)
    timeouts: int  # calls that ran past reward.timeout_s (scored 0)
    extras: dict[str, list[float]]
    first_error: str | None


@dataclass
class ScoredRollout:
    """One batch of prompts generated and scored (samples in the order of each output)."""

    rows: list[PromptRow]
    outs: list[RequestOutput]
    scores: list[list[float]]
    errors: int  # reward calls that raised (scored 0)
    timeouts: int  # reward calls past reward.timeout_s (scored 0)
    first_error: str | None
    extras: dict[str, list[float]]  # extra values reward functions returned
    predicted: list[float | None]  # HistoPipe's length prediction per prompt (None: no history)
    gen_s: float  # generation time, the reward time overlapping it excluded
    reward_s: float
    carry: list[CarriedGroup]  # groups paused at the step's token budget (partial rollouts)
    offpolicy_tokens: int  # tokens of ``outs`` drawn under earlier steps' weights
    version: int = 0  # the policy version (updates applied) that drew it
    stats: dict[str, float] = field(default_factory=dict)  # engine and scheduler counters over this rollout
    streamed: Any = None  # the prompt split's update work on these groups (StreamedUpdate), if any

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (a checkpoint holds the batch an async run had in flight)."""
        return {"keys": [r.key for r in self.rows], "outs": [_out_to_dict(o) for o in self.outs],
                "scores": self.scores, "errors": self.errors, "timeouts": self.timeouts,
                "first_error": self.first_error, "extras": self.extras, "predicted": self.predicted,
                "gen_s": self.gen_s, "reward_s": self.reward_s, "carry": [g.to_dict() for g in self.carry],
                "offpolicy_tokens": self.offpolicy_tokens, "version": self.version, "stats": self.stats}

    @classmethod
    def from_dict(cls, d: dict[str, Any], row_of: dict[str, PromptRow]) -> "ScoredRollout":
        """Inverse of :meth:`to_dict`; malformed input raises KeyError, TypeError or ValueError."""
        return cls([row_of[k] for k in d["keys"]], [_out_from_dict(o) for o in d["outs"]],
                   [[float(x) for x in g] for g in d["scores"]], int(d["errors"]), int(d["timeouts"]),
                   d["first_error"], {k: [float(x) for x in v] for k, v in d["extras"].items()},
                   list(d["predicted"]), float(d["gen_s"]), float(d["reward_s"]),
                   [CarriedGroup.from_dict(g) for g in d["carry"]], int(d["offpolicy_tokens"]),
                   int(d["version"]), {k: float(v) for k, v in d["stats"].items()})


def _out_to_dict(o: RequestOutput) -> dict[str, Any]:
    return {"request_id": o.request_id, "prompt_token_ids": o.prompt_token_ids, "prompt_key": o.prompt_key,
            "error": o.error, "outputs": [asdict(c) for c in o.outputs]}


def _out_from_dict(d: dict[str, Any]) -> RequestOutput:
    return RequestOutput(int(d["request_id"]), [int(x) for x in d["prompt_token_ids"]],
                         [CompletionOutput(**c) for c in d["outputs"]], d["prompt_key"], d["error"])


class _InFlight:
    """A rollout running in a background thread (async RL) or done (restored from a checkpoint)."""

    def __init__(self, step: int, result: ScoredRollout | None = None) -> None:
        self.step, self.result = step, result
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self, fn: Any, *args: Any) -> None:
        def body() -> None:
            try:
                self.result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised in the training thread by wait()
                self.error = e

        self.thread = threading.Thread(target=body, name=f"rhymerl-rollout-{self.step}", daemon=True)
        self.thread.start()

    def wait(self) -> ScoredRollout:
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


_SPEC_COUNTERS = ("forwards", "decode_rows", "accepted", "drafted", "draft_s", "generated")


class RLRun:
    """All state of one training run; ``run()`` executes it from its current step.

    Synchronous (``trainer.async_staleness=0``): each step generates with the weights it
    trains. Async (S >= 1): step t's batch is drawn by policy version ``max(0, t-1-S)`` and
    generated in a background thread while step t-1 trains; the workers get a version only
    at a step boundary, so which version drew a batch never depends on timing.
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, *, progress: bool = True) -> None:
        self.cfg, self.run_dir, self.progress = cfg, run_dir, progress
        run_dir.mkdir(parents=True, exist_ok=True)
        if latest_checkpoint(run_dir) is None:  # a run's record is written once, never on resume
            save_config(cfg, run_dir / "config.yaml")
        base = ensure_base_model(cfg)
        self.device = resolve_device(cfg.model.device)
        dtype = resolve_dtype(cfg.model.dtype)
        self.tokenizer = load_tokenizer(base)
        distributed = cfg.trainer.world_size > 1
        # Many ranks: this process keeps a CPU copy of the policy, which rank 0 publishes into
        # after each update; the rollout workers sync from it and checkpoints are written from it.
        on_cpu = self.device.type == "cpu" or distributed
        self.model = load_pretrained(base, device="cpu" if distributed else self.device,
                                     dtype=torch.float32 if on_cpu else dtype)
        ref = copy.deepcopy(self.model).eval().requires_grad_(False) \
            if cfg.algorithm.kl_coef > 0 and not distributed else None
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
        sources = tuple(sorted({r.data_source for r in self.train_rows + self.val_rows}))
        self.reward_spec = RewardSpec(cfg.data.reward_file, cfg.data.reward_fn_name, sources)
        self.rewards = RewardPool(self.reward_spec, workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s)
        steps_per_update = cfg.trainer.ppo_epochs * cfg.trainer.ppo_mini_batches
        total = cfg.trainer.steps * steps_per_update
        self.trainer: PolicyTrainer | TrainerGroup
        self.draft_head = None
        if distributed:
            from rhymerl.training.trainer_group import TrainerGroup

            try:
                self.trainer = TrainerGroup(cfg, base, self.model, with_ref=cfg.algorithm.kl_coef > 0,
                                            total_optimizer_steps=total)
            except BaseException:
                self.rewards.close()
                raise
        else:
            if trains_draft_head(cfg.rollout.speculative):
                from rhymerl.training.draft_head_trainer import DraftHeadTrainer

                self.draft_head = DraftHeadTrainer(self.model, cfg.rollout.speculative.draft_head_lr, self.device,
                                                   seed=cfg.seed)
            self.trainer = PolicyTrainer(self.model, cfg.trainer, cfg.algorithm, self.device, ref,
                                         total_optimizer_steps=total, temperature=cfg.rollout.temperature,
                                         top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                                         draft_head=self.draft_head)
        self.sync_bytes = sum(p.numel() * 4 for p in self._named().values())  # float32 to the workers (head too)
        spec = cfg.rollout.speculative
        self.history = None
        if spec.method != "none" or cfg.rollout.schedule == "histopipe":
            from rhymerl.drafting import HistoryStore

            # The controller's store: workers draft from the parts shipped with their work,
            # HistoPipe predicts lengths from it, and it is saved with every checkpoint.
            self.history = HistoryStore(max_rollouts=max(1, spec.history_epochs),
                                        tokenizer_fingerprint=tokenizer_fingerprint(self.tokenizer))
        from rhymerl.distribution.factory import build_coordinator

        try:
            self.rollout = build_coordinator(cfg, base, self._named(),
                                             tokenizer=self.tokenizer, history=self.history)
        except BaseException:
            self.rewards.close()  # no reward or trainer processes left behind by a run that cannot start
            if distributed:
                self.trainer.close()
            raise
        self.metrics = MetricsLogger(run_dir)
        self.staleness = cfg.trainer.async_staleness
        # Async RL's update and a streamed update overlap the rollout: on a CPU they keep to the
        # cores the workers leave (on 2 cores a 2-thread update beside the 1-thread worker ran
        # 3.2-4x slower). Trainer ranks are processes of their own (0: leave the count alone).
        from rhymerl.distribution.factory import trainer_threads_beside_workers

        overlaps = self.staleness or cfg.trainer.stream_update
        self.update_threads = (trainer_threads_beside_workers(cfg)
                               if overlaps and isinstance(self.trainer, PolicyTrainer) else 0)
        self.prompt_split = minibatch_split(cfg) == "prompts"  # the update starts on groups as they land
        self.version = 0  # updates applied to self.model
        self.worker_version = 0  # the version the rollout workers hold
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}  # async: older versions batches may still need
        self.inflight: _InFlight | None = None  # async: the next step's batch
        self.step = 0
        self.initial_accuracy: dict[str, float] | None = None
        self.carried: list[CarriedGroup] = []  # paused groups waiting for the next step
        self._row_of = {row.key: row for row in self.train_rows}
        if cfg.rollout.carry_over_tokens > 0:
            log.warning("rollout.carry_over_tokens=%d: samples unfinished after that many tokens continue in "
                        "the next step under newer weights; those groups train off-policy",
                        cfg.rollout.carry_over_tokens)

    # --- resume ----------------------------------------------------------------------------
    def resume(self) -> bool:
        """Continue from the newest checkpoint that loads; a damaged one is skipped with a
        warning (it is never used half-way), and all of them damaged is an error."""
        ckpts = complete_checkpoints(self.run_dir)
        if not ckpts:
            # Killed before its first checkpoint: it starts over, so what it logged goes too
            # (found by fault injection: a kill mid-step-1 left a step-0 row that was logged again).
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
            inflight = None if inflight is None else _InFlight(
                int(inflight["step"]), ScoredRollout.from_dict(inflight["rollout"], self._row_of))
            snapshots = {}
            if (ckpt / "snapshots.pt").exists():
                snapshots = {int(v): named for v, named in
                             torch.load(ckpt / "snapshots.pt", weights_only=True).items()}
            initial = state.get("initial_accuracy")
            if initial is not None and not (isinstance(initial, dict) and all(
                    isinstance(v, (int, float)) for v in initial.values())):
                raise ValueError(f"initial_accuracy {initial!r} is not a mapping of numbers")
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{ckpt / 'state.json'}: malformed ({type(e).__name__}: {e})") from e
        self.step = state["step"]
        self.initial_accuracy = initial
        self.trainer.bad_steps = bad_steps
        self.carried = carried
        self.inflight = inflight
        self.version = self.step
        self.snapshots = snapshots
        gate = state.get("gate")
        if self.history is not None:
            from rhymerl.drafting import HistoryStore

            # A missing or damaged store is discarded inside load (history only accelerates).
            loaded = HistoryStore.load(ckpt / "history.json.gz",
                                       tokenizer_fingerprint=tokenizer_fingerprint(self.tokenizer))
            self.history.replace_with(loaded)
        return gate if isinstance(gate, list) else []

    def _after_restore(self, gate: list) -> None:
        self.rollout.pool.update_weights(self._named())
        self.worker_version = self.version
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

    # --- one step ------------------------------------------------------------------------------
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
                                  logprobs=budget > 0 or self.staleness > 0)

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
                             version=self.version if version is None else version, streamed=streamed,
                             stats={**{k: getattr(st, k) - s0[k] for k in _SPEC_COUNTERS},
                                    **{f"src/{k}": v - src0.get(k, 0) for k, v in self.rollout.source_stats.items()},
                                    **{f"pipe/{k}": v - p0[k] for k, v in vars(pipe).items()}})

    def _prompt_split_update(self, first: ScoredRollout, kept_outs: list[RequestOutput], step: int,
                             metrics: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """The update of a prompt-split step: the work already done on each group as it landed
        (streamed) is finished, then the optimizer steps. Returns the trained responses'
        rewards and advantages, the seconds waited for the groups' work, and the update's."""
        from rhymerl.training.stream import stream_update

        streamed, cfg = first.streamed, self.cfg
        t = time.perf_counter()
        streamed.finish()
        old_s = time.perf_counter() - t
        slot_of = {id(o): i for i, o in enumerate(first.outs)}
        slots = [slot_of[id(o)] for o in kept_outs]
        t = time.perf_counter()
        upd = stream_update(self.trainer, streamed, slots, step, cfg.seed, cfg.trainer.ppo_mini_batches,
                               cfg.trainer.ppo_epochs)
        metrics.update(upd)
        upd_s = time.perf_counter() - t
        groups = [streamed.groups[s] for s in slots]
        reward_t = torch.cat([g.reward for g in groups]) if groups else torch.zeros(0)
        adv = torch.cat([g.exp.advantages for g in groups]) if groups else torch.zeros(0)
        if cfg.algorithm.use_kl_in_reward and groups:
            metrics["critic/kl_in_reward"] = sum(g.kl_in_reward for g in groups) / len(reward_t)
        metrics["timing_s/streamed"] = streamed.busy_s  # work on groups, hidden in the rollout or not
        if not groups:
            log.warning("step %d: every group had equal rewards; no update", step)
        return reward_t, adv, old_s, upd_s

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

    # --- versions of the policy (async RL) ---------------------------------------------------------
    def _version_for(self, step: int) -> int:
        """The policy version that draws step ``step``'s batch: a function of the step alone."""
        return max(0, step - 1 - self.staleness)

    def _keep_current(self, step: int) -> None:
        """Async: copy the current weights before step ``step``'s update replaces them, if a batch
        may still be drawn by them (step t+1's is drawn by version t-S; the run may also be
        resumed or extended before it is, so the copies travel in checkpoints). Only versions
        older than the live weights are ever copied."""
        if self.staleness:
            oldest = step - self.staleness
            self.snapshots = {v: w for v, w in self.snapshots.items() if v >= oldest}
            if self.version >= oldest:
                self.snapshots[self.version] = {n: p.detach().clone() for n, p in self._named().items()}

    def _push(self, version: int) -> None:
        """The rollout workers to policy ``version`` (nothing to do if they hold it)."""
        if self.worker_version == version:
            return
        named = self._named() if version == self.version else self.snapshots[version]
        self.rollout.pool.update_weights(named)
        self.worker_version = version

    def _collect(self, step: int) -> tuple[ScoredRollout, float]:
        """Step ``step``'s batch, and the seconds spent waiting for it: the one launched during
        the previous step (async), or generated now."""
        t = time.perf_counter()
        if self.inflight is not None:
            if self.inflight.step != step:
                raise RuntimeError(f"the batch in flight is step {self.inflight.step}'s, not step {step}'s")
            out, self.inflight = self.inflight.wait(), None
            return out, time.perf_counter() - t
        rows = self.loader.next_batch()
        self._push(self._version_for(step))
        out = self._rollout(rows, step, self.carried, version=self._version_for(step), split=self.prompt_split)
        return out, time.perf_counter() - t

    def _launch(self, step: int) -> None:
        """Start step ``step``'s rollout in the background (async RL)."""
        rows = self.loader.next_batch()
        version = self._version_for(step)
        self._push(version)
        self.inflight = _InFlight(step)
        self.inflight.start(self._rollout, rows, step, self.carried, version)

    def settle(self) -> None:
        """Let the batch in flight finish (its result is kept): before the workers are needed
        for something else (evaluation) or the state is saved."""
        if self.inflight is not None and self.inflight.thread is not None:
            self.inflight.thread.join()

    def train_step(self, step: int) -> dict[str, Any]:
        cfg, algo = self.cfg, self.cfg.algorithm
        t_step = time.perf_counter()
        first, wait_s = self._collect(step)
        carry, offpolicy = list(first.carry), first.offpolicy_tokens
        rows, outs, scores, errors, extras = first.rows, first.outs, first.scores, first.errors, first.extras
        timeouts = first.timeouts
        scored_n = sum(len(g) for g in scores)
        if scored_n and errors + timeouts == scored_n:
            # Broken, not unlucky: an import error or a typo fails every row, and training on
            # all-zero rewards would look like a run that learns nothing.
            raise RewardFunctionError(
                f"step {step}: the reward function {self._reward_fn_name(rows[0].data_source)} failed on every one of "
                f"the step's {scored_n} responses ({errors} raised, {timeouts} timed out); first: {first.first_error}")
        # rewards ran while other prompts were still generating: rollout time excludes them
        gen_s, reward_s = first.gen_s, first.reward_s
        kept_rows, kept_outs, kept_scores = rows, outs, scores
        filtered = 0
        more_stats: list[dict[str, float]] = []
        if algo.dynamic_sampling:  # DAPO: drop groups that teach nothing, draw more (bounded)
            keep = [i for i, g in enumerate(scores) if informative(g)]
            filtered = len(rows) - len(keep)
            kept_rows = [rows[i] for i in keep]
            kept_outs = [outs[i] for i in keep]
            kept_scores = [scores[i] for i in keep]
            for _ in range(algo.max_resample_batches):
                if len(kept_rows) >= cfg.trainer.batch_prompts:
                    break
                more = self._rollout(self.loader.next_batch(), step)  # synchronous only (config check)
                more_stats.append(more.stats)
                carry += more.carry
                gen_s += more.gen_s
                reward_s += more.reward_s
                errors += more.errors
                timeouts += more.timeouts
                for r_, o_, s_ in zip(more.rows, more.outs, more.scores):
                    if informative(s_):
                        kept_rows.append(r_)
                        kept_outs.append(o_)
                        kept_scores.append(s_)
            kept_rows = kept_rows[: cfg.trainer.batch_prompts]
            kept_outs = kept_outs[: cfg.trainer.batch_prompts]
            kept_scores = kept_scores[: cfg.trainer.batch_prompts]
        self.carried = carry
        epoch = self.loader.state.epoch  # the trained batch's (async draws the next one just below)
        if self.staleness and step < cfg.trainer.steps:
            self._launch(step + 1)  # generates while this batch trains

        prompts, responses, flat_scores, groups, lengths, behaviour = [], [], [], [], [], []
        for gi, (o, g) in enumerate(zip(kept_outs, kept_scores)):
            for c, s in zip(o.outputs, g):
                prompts.append(o.prompt_token_ids)
                responses.append(c.token_ids)
                behaviour.append(c.logprobs or [])
                flat_scores.append(s)
                groups.append(gi)
                lengths.append(len(c.token_ids))
        reward_t = torch.zeros(0)
        metrics: dict[str, Any] = {}
        self._keep_current(step)
        if first.streamed is not None:
            reward_t, adv, old_s, upd_s = self._prompt_split_update(first, kept_outs, step, metrics)
        elif responses:
            exp = Experience.build(prompts, responses, [0.0] * len(responses), self.tokenizer.pad_token_id or 0,
                                   behaviour_logprobs=behaviour if self.staleness else None)
            # async RL: this update runs beside the next batch's rollout, on the cores its worker
            # leaves (a fixed count, so its numbers never depend on which finishes first; a
            # synchronous step has update_threads 0 and keeps every core)
            with torch_threads(self.update_threads):
                t = time.perf_counter()
                self.trainer.compute_logps(exp)
                old_s = time.perf_counter() - t
                if self.staleness:
                    metrics.update(async_metrics(exp, step - 1 - first.version, algo.is_cap))
                reward_t, seq_kl = shaped_rewards(torch.tensor(flat_scores, dtype=torch.float32),
                                                  torch.tensor(lengths), algo, cfg.rollout.max_tokens, exp.old_logp,
                                                  exp.ref_logp, exp.response_mask)
                if seq_kl is not None:
                    metrics["critic/kl_in_reward"] = float(seq_kl.mean())
                adv = ADV_ESTIMATORS[algo.adv_estimator](reward_t, torch.tensor(groups),
                                                         norm_by_std=algo.norm_adv_by_std)
                exp.advantages = adv.float()
                t = time.perf_counter()
                metrics.update(self.trainer.update(exp, step, cfg.seed))
                upd_s = time.perf_counter() - t
        else:
            old_s = upd_s = 0.0
            log.warning("step %d: every group had equal rewards; no update", step)
        t = time.perf_counter()
        sync_bytes = 0
        if not isinstance(self.trainer, PolicyTrainer):
            sync_bytes += self.trainer.publish().bytes  # the ranks' new weights into this process's copy
        self.version = step
        if not self.staleness:  # async: the workers get a version when a launch asks for it
            self._push(self.version)
            sync_bytes += self.sync_bytes
        sync_s = time.perf_counter() - t
        step_s = time.perf_counter() - t_step

        # A step whose every group paused at the token budget trains on nothing (partial rollouts).
        all_scores = [s for g in scores for s in g] or [0.0]
        all_lens = [len(c.token_ids) for o in outs for c in o.outputs] or [0]
        counts = {k: first.stats.get(k, 0.0) + sum(m.get(k, 0.0) for m in more_stats) for k in first.stats}
        rows_f = counts.get("decode_rows", 0.0)
        acc = counts.get("accepted", 0.0)
        drafted = counts.get("drafted", 0.0)
        gen_tokens = counts.get("generated", 0.0)
        metrics.update({
            "critic/score/mean": float(np.mean(all_scores)),
            "critic/score/max": float(np.max(all_scores)),
            "critic/rewards/mean": float(reward_t.mean()) if responses else 0.0,
            "critic/advantages/abs_mean": float(adv.abs().mean()) if responses else 0.0,
            "response_length/mean": float(np.mean(all_lens)),
            "response_length/max": int(np.max(all_lens)),
            "response_length/min": int(np.min(all_lens)),
            "response_length/clip_ratio": float(np.mean([c.finish_reason == "length" for o in outs
                                                         for c in o.outputs] or [0.0])),
            "reward/errors": errors,
            "reward/timeouts": timeouts,
            "data/filtered_groups": filtered,
            "rollout/carried_groups": len(self.carried),
            "rollout/offpolicy_tokens": offpolicy,
            "rollout/offpolicy_fraction": offpolicy / max(1, sum(all_lens)),
            "data/epoch": epoch,
            "timing_s/gen": gen_s, "timing_s/reward": reward_s, "timing_s/old_logp": old_s,
            "timing_s/update": upd_s, "timing_s/sync": sync_s, "timing_s/step": step_s,
            "perf/sync_bytes": sync_bytes,
            "perf/throughput": gen_tokens / step_s,
            "perf/gen_tokens_per_s": gen_tokens / max(gen_s, 1e-9),
            "spec/accepted_per_forward": (rows_f + acc) / rows_f if rows_f else 1.0,
            "spec/forwards_per_token": rows_f / max(1, gen_tokens - (len(all_lens) if all_lens else 0)),
            "spec/acceptance_rate": acc / drafted if drafted else 0.0,
            "spec/draft_ms": 1000 * counts.get("draft_s", 0.0),
            "spec/decode_forwards": counts.get("forwards", 0.0),
            "spec/decode_rows": rows_f,
            "spec/decode_tokens": rows_f + acc,
        })
        metrics.update({f"reward_extra/{k}": float(np.mean(v)) for k, v in extras.items()})
        metrics.update({k: v for k, v in counts.items() if k.startswith("pipe/")})
        for k, v in counts.items():  # per draft source: tokens accepted, and the head's acceptance
            if k.startswith("src/accepted/"):
                src = k[len("src/accepted/"):]
                metrics[f"spec/accepted_tokens/{src}"] = v
                if src == "draft_head":
                    metrics["draft/accept_rate"] = v / max(1.0, counts.get(f"src/drafted/{src}", 0.0))
        if self.staleness:
            metrics["timing_s/wait_rollout"] = wait_s  # the rollout time the step still waited for
        metrics["pipe/workers"] = self.rollout.num_workers
        true_mean = [float(np.mean([len(c.token_ids) for c in o.outputs])) for o in outs]
        known = [(p, t) for p, t in zip(first.predicted, true_mean) if p is not None]
        if len(known) >= 3:
            from rhymerl.scheduling import spearman

            metrics["pipe/length_rank_corr"] = spearman([k[0] for k in known], [k[1] for k in known])
        trained = {id(o) for o in kept_outs}
        with open(self.run_dir / "traces.jsonl", "a") as f:  # per-sample lengths: what `bench pipe` replays
            f.write(json.dumps({"step": step, "keys": [row.key for row in rows], "predicted": first.predicted,
                                "prompt_lens": [len(o.prompt_token_ids) for o in outs],
                                "lengths": [[len(c.token_ids) for c in o.outputs] for o in outs],
                                "forwards": [[c.num_forwards for c in o.outputs] for o in outs],
                                # which groups the update trained on (DAPO's filter drops the rest)
                                "trained": [id(o) in trained for o in outs],
                                "gen_s": gen_s}) + "\n")
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy: greedy, and avg@4 at the rollout temperature (what RL optimises)."""
        r = self.cfg.rollout
        greedy = evaluate(self.rollout, self.val_rows, self.rewards, max_tokens=r.max_tokens)
        out = {"val/accuracy": greedy.accuracy}
        if r.temperature > 0:
            sampled = evaluate(self.rollout, self.val_rows, self.rewards, max_tokens=r.max_tokens,
                               temperature=r.temperature, n=4, seed=self.cfg.seed + 7)
            out["val/accuracy_sampled"] = sampled.accuracy
        return out

    # --- the run ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        try:
            return self._run()
        finally:
            self.close()

    def _save_trainer_state(self, folder: Path) -> None:
        self.trainer.save_state(folder)
        if self.snapshots:  # async: the older versions later batches are drawn by
            torch.save({str(v): w for v, w in self.snapshots.items()}, folder / "snapshots.pt")

    def close(self) -> None:
        """Stop the rollout workers and the reward processes (idempotent)."""
        if self.inflight is not None and self.inflight.thread is not None:
            self.inflight.thread.join(timeout=600)  # never stop workers under a running rollout
        self.rollout.pool.close()
        self.rewards.close()
        if not isinstance(self.trainer, PolicyTrainer):
            self.trainer.close()

    def _reward_fn_name(self, data_source: str) -> str:
        spec = self.reward_spec
        if spec.reward_file and data_source in spec.sources:
            return spec.user_fn_name()
        return f"for data_source {data_source!r}"

    def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        t0 = time.perf_counter()
        if self.initial_accuracy is None and self.val_rows:
            self.initial_accuracy = self.evaluate()
            self.metrics.log(0, {**self.initial_accuracy, **self.dropped_rows})
        last_val = float("nan")
        bar = tqdm(range(self.step + 1, cfg.trainer.steps + 1), desc="rl", disable=not self.progress,
                   initial=self.step, total=cfg.trainer.steps)
        for step in bar:
            m = self.train_step(step)
            if self.val_rows and (_every(step, cfg.trainer.eval_every) or step == cfg.trainer.steps):
                self.settle()  # the workers finish the batch in flight, then evaluate this step's policy
                self._push(self.version)
                m.update(self.evaluate())
                last_val = m["val/accuracy"]
            self.metrics.log(step, m)
            self.step = step
            bar.set_postfix(reward=f"{m['critic/score/mean']:.2f}", gen=f"{m['timing_s/gen']:.1f}s",
                            acc_fwd=f"{m['spec/accepted_per_forward']:.2f}",
                            val=f"{last_val:.2f}")
            if _every(step, cfg.trainer.save_every) or step == cfg.trainer.steps:
                # Async: the batch in flight is saved whole, so a resumed run trains on exactly it.
                self.settle()
                inflight = None if self.inflight is None else {"step": self.inflight.step,
                                                               "rollout": self.inflight.wait().to_dict()}
                save_checkpoint(self.run_dir, step, self.model, self.tokenizer, self._save_trainer_state,
                                {"loader": self.loader.state_dict(), "initial_accuracy": self.initial_accuracy,
                                 "world_size": cfg.trainer.world_size, "strategy": cfg.trainer.strategy,
                                 "inflight": inflight,
                                 "bad_steps": self.trainer.bad_steps,
                                 "carried": [g.to_dict() for g in self.carried],
                                 "gate": self.rollout.pool.gate_states()},
                                self.history)
        bar.close()
        self.metrics.close()
        plots = plot_run(self.run_dir)
        summary = summarize(self.run_dir, self.initial_accuracy, time.perf_counter() - t0)
        summary["plots"] = [str(p) for p in plots]
        summary["machine"] = machine_info()  # exactness holds per CPU model, torch build and threads
        atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary


def _every(step: int, period: int) -> bool:
    """Whether a periodic action falls on ``step`` (period <= 0: never; the last step still does)."""
    return period > 0 and step % period == 0


def async_metrics(exp: Experience, staleness: int, cap: float) -> dict[str, float]:
    """How far the update's batch is off-policy: policy versions behind, and the importance
    ratio proximal / behaviour over its response tokens (``clipped_frac``: above the cap)."""
    assert exp.old_logp is not None and exp.behav_logp is not None
    m = exp.response_mask.bool()
    ratio = torch.exp((exp.old_logp - exp.behav_logp).clamp(max=20.0))[m]
    if not ratio.numel():
        ratio = torch.ones(1)
    return {"async/staleness_mean": float(staleness), "async/is_ratio_mean": float(ratio.mean()),
            "async/is_ratio_max": float(ratio.max()), "async/clipped_frac": float((ratio > cap).float().mean())}


def summarize(run_dir: Path, initial: dict[str, float] | None, wall_s: float) -> dict[str, Any]:
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "timing_s/step" in r]
    vals = [r for r in read_metrics(run_dir / "metrics.jsonl") if "val/accuracy" in r]
    if not rows:
        return {}

    def total(k: str) -> float:
        return float(sum(r.get(k, 0.0) for r in rows))

    steps_s = total("timing_s/step")
    return {
        "steps": len(rows),
        "accuracy_before": (initial or {}).get("val/accuracy"),
        "accuracy_after": vals[-1]["val/accuracy"] if vals else None,
        "sampled_accuracy_before": (initial or {}).get("val/accuracy_sampled"),
        "sampled_accuracy_after": vals[-1].get("val/accuracy_sampled") if vals else None,
        "wall_s": wall_s,
        "time_split": {k.split("/")[1]: round(total(k) / steps_s, 3) for k in
                       ("timing_s/gen", "timing_s/reward", "timing_s/old_logp", "timing_s/update", "timing_s/sync")},
        # from summed counts, so both figures describe the same thing
        "spec_accepted_per_forward": total("spec/decode_tokens") / max(1.0, total("spec/decode_rows")),
        "spec_forwards_per_token": total("spec/decode_rows") / max(1.0, total("spec/decode_tokens")),
        "final_score": rows[-1]["critic/score/mean"],
    }


def print_summary(s: dict[str, Any], run_dir: Path) -> None:
    if not s:
        return
    b, a = s["accuracy_before"], s["accuracy_after"]
    print(f"\nrun: {run_dir}  ({s['steps']} steps, {s['wall_s']:.0f}s)")
    if b is not None and a is not None:
        print(f"held-out greedy accuracy: {100 * b:.1f}% -> {100 * a:.1f}% ({100 * (a - b):+.1f} points)")
    sb, sa = s.get("sampled_accuracy_before"), s.get("sampled_accuracy_after")
    if sb is not None and sa is not None:
        print(f"held-out sampled accuracy (avg@4 at the rollout temperature): {100 * sb:.1f}% -> {100 * sa:.1f}% "
              f"({100 * (sa - sb):+.1f} points)")
    print("time split: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in s["time_split"].items()))
    print(f"speculation: {s['spec_accepted_per_forward']:.2f} tokens per sequence per forward "
          f"(= {1 / max(s['spec_forwards_per_token'], 1e-9):.2f}x fewer target forwards per token); "
          f"`rhymerl bench e2e` measures the wall-clock speed-up against no speculation")
    for p in s.get("plots", []):
        print(f"plots: {p}")


# Where a run executes, not what it learns: these may change when a run is resumed (for
# example on another number of trainer ranks: the sharded checkpoint is resharded).
RESUME_OVERRIDES = ("trainer.world_size", "trainer.strategy", "trainer.collective_timeout_s",
                    "trainer.rank_timeout_s", "rollout.workers", "rollout.backend", "rollout.worker_timeout_s",
                    "reward.workers", "cluster.address", "model.device")


def load_run_config(run_dir: Path, overrides: list[str] | None = None) -> RunConfig:
    """A run folder's own config: missing or empty is an error, never the defaults.
    ``overrides`` may change only the placement keys of :data:`RESUME_OVERRIDES`."""
    path = run_dir / "config.yaml"
    if not path.exists():
        raise ConfigError(f"{path}: missing (not a run folder, or its config was deleted); cannot resume")
    if not path.read_text().strip():
        raise ConfigError(f"{path}: empty; a run's config is never empty, refusing to resume on the defaults")
    for o in overrides or []:
        key = o.split("=", 1)[0].strip()
        if key not in RESUME_OVERRIDES:
            raise ConfigError(f"{key}: cannot change when resuming {run_dir} (it would change what is learned); "
                              f"keys that may change: {list(RESUME_OVERRIDES)}")
    return load_config(path, overrides)


def train(cfg: RunConfig | None = None, *, resume: str | None = None, config_path: str | None = None,
          progress: bool = True, resume_overrides: list[str] | None = None) -> int:
    if resume:
        run_dir = Path(resume)
        cfg = load_run_config(run_dir, resume_overrides)
    else:
        cfg = cfg or load_config()
        run_dir = run_dir_for(cfg)
        if latest_checkpoint(run_dir) is not None:
            print(f"{run_dir} already has checkpoints: continuing it (use another trainer.output_dir to start anew)")
    run = RLRun(cfg, run_dir, progress=progress)
    run.resume()
    summary = run.run()
    print_summary(summary, run_dir)
    return 0
