"""The update streamed into the rollout's tail (``trainer.stream_update``), and the prompt-level
mini-batch split it needs.

While a step's last samples generate, the groups already finished and scored have their old
(and reference) log-probs computed, and the first mini-batch's gradient accumulated; its
optimizer step waits for the step's last group. Every response still comes from the step's
weights (nothing here is off-policy) and the update is the same computation.

What makes that exact rather than approximate:

- **Which mini-batch a group joins is drawn before the rollout**, over the step's prompt
  slots (verl's granularity: a group's samples share a mini-batch); groups the filter drops
  leave theirs. Splitting the *kept samples* instead (the default ``samples`` split) needs the
  filter's outcome for every group first.
- **One code path, streamed or not.** Groups are processed in a fixed order (predicted length
  from history, then the slot's draw: short groups tend to finish first), each with its own
  forwards; the mini-batch's gradient is accumulated unnormalised and divided by its token
  count once that is known (token-mean loss: the division is linear). ``stream_update=false``
  with ``minibatch_split=prompts`` runs exactly this after the rollout: streaming changes only
  when the work runs, so both learn the same bits (``bench e2e`` checks it).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rhymerl.algos import ADV_ESTIMATORS, shaped_rewards
from rhymerl.training.rollout.batch import ScoredRollout, UpdateResult
from rhymerl.training.update.trainer import Experience, PolicyTrainer

log = logging.getLogger(__name__)



def prompt_minibatches(num_slots: int, mini_batches: int, seed: int, step: int, epoch: int) -> list[list[int]]:
    """The step's prompt slots drawn into ``mini_batches`` mini-batches for PPO epoch ``epoch``:
    a function of the seed, step and epoch alone (known before the rollout)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 7919 + epoch)
    return [c.tolist() for c in torch.randperm(num_slots, generator=g).chunk(mini_batches)]


@dataclass
class GroupRows:
    """One prompt's scored responses, ready for the update."""

    prompt: list[int]
    responses: list[list[int]]
    exp: Experience  # old/ref log-probs and advantages filled
    tokens: int  # response tokens
    reward: torch.Tensor  # per response: score, overlong penalty and in-reward KL
    kl_in_reward: float = 0.0  # summed over its responses (use_kl_in_reward)


@dataclass
class _Slot:
    prompt: list[int]
    responses: list[list[int]]
    scores: list[float]


@dataclass
class StreamedUpdate:
    """The prompt split's work on one step's groups: per group its log-probs and advantages, and
    the first mini-batch's gradient accumulated into the policy's ``.grad``.

    Args:
        trainer: the policy's trainer (one process).
        cfg: the run config (algorithm and rollout sections).
        pad_id: padding token.
        order: every prompt slot, in the order groups are processed.
        first: the slots of the first mini-batch of the first PPO epoch.
        background: process groups in a thread as they arrive (streaming); else all at
            :meth:`finish`.
        threads: torch threads of every group's work (the cores the rollout workers leave;
            0: torch's default). Once the rollout is over (:meth:`finish`) the caller's thread
            computes later groups' log-probs beside the helper, at the same count.
    """

    trainer: PolicyTrainer
    cfg: Any
    pad_id: int
    order: list[int]
    first: set[int]
    background: bool = True
    threads: int = 0
    groups: dict[int, GroupRows] = field(default_factory=dict, init=False)
    first_tokens: int = field(default=0, init=False)
    finite: bool = field(default=True, init=False)
    sums: list[tuple[str, float, float]] = field(default_factory=list, init=False)  # the first mini-batch's metrics
    busy_s: float = field(default=0.0, init=False)  # time spent processing, streamed or not

    def __post_init__(self) -> None:
        self._arrived: dict[int, _Slot | None] = {}
        self._cv = threading.Condition()
        self._next = 0
        self._taken: set[int] = set()  # groups whose log-probs a thread is computing
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if self.background:
            self.trainer.optimizer.zero_grad(set_to_none=True)
            self._thread = threading.Thread(target=self._loop, name="stream-update", daemon=True)
            self._thread.start()

    # --- from the rollout ---------------------------------------------------------------------
    def add(self, slot: int, prompt: list[int] | None, responses: list[list[int]], scores: list[float]) -> None:
        """Group ``slot`` is whole and scored; ``prompt`` None: it trains on nothing (filtered)."""
        with self._cv:
            self._arrived[slot] = _Slot(prompt, responses, scores) if prompt is not None else None
            self._cv.notify_all()

    def finish(self) -> None:
        """Every group is in: process what is left."""
        with self._cv:
            for s in self.order:  # a slot the rollout never reported trains on nothing
                self._arrived.setdefault(s, None)
            self._cv.notify_all()
        if self._thread is None:
            self.trainer.optimizer.zero_grad(set_to_none=True)
            while (job := self._pick()) is not None and job[1] >= 0:
                self._run(*job)
            return
        # The rollout's cores are free: this thread computes later groups' log-probs beside the
        # helper (independent work), at the helper's thread count, so every group's numbers are
        # the same whichever thread computed them (torch's CPU kernels can differ in the last
        # bits between thread counts; run to run, a streamed step is the same).
        before = torch.get_num_threads()
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        try:
            while self._error is None:
                with self._cv:
                    slot = next((s for s in reversed(self.order[self._next + 1:])
                                 if self._arrived.get(s) is not None and s not in self.groups and s not in self._taken),
                                None)
                    if slot is None:
                        break
                    self._taken.add(slot)
                self._run(False, slot)
        finally:
            if self.threads > 0:
                torch.set_num_threads(before)
        self._thread.join()
        if self._error is not None:
            raise self._error

    # --- the work -------------------------------------------------------------------------------
    def _pick(self) -> tuple[bool, int] | None:
        """The helper's next piece of work (under the lock): ``(True, slot)`` the next group in
        order (the first mini-batch's gradient accumulates in that order, so it is the same sum
        streamed or not), else ``(False, slot)`` the log-probs of a later group that has landed
        (a group's log-probs depend on nothing else); ``(True, -1)`` when every group is done,
        None when nothing that has landed is free to take."""
        if self._next >= len(self.order):
            return True, -1
        slot = self.order[self._next]
        if slot in self._arrived:
            return None if slot in self._taken else (True, slot)  # taken: the other thread's, wait
        for s in self.order[self._next + 1:]:
            if self._arrived.get(s) is not None and s not in self.groups and s not in self._taken:
                return False, s
        return None

    def _loop(self) -> None:
        try:
            if self.threads > 0:
                # torch's intra-op thread count is per thread here (OpenMP's), so this leaves
                # the caller's alone; the helper keeps to the cores the worker leaves.
                torch.set_num_threads(self.threads)
            while True:
                with self._cv:
                    while (job := self._pick()) is None:
                        self._cv.wait()
                    if job[1] < 0:
                        return
                    self._taken.add(job[1])
                self._run(*job)
        except BaseException as e:  # raised again in the controller's thread, at finish
            self._error = e
            with self._cv:
                self._cv.notify_all()

    def _run(self, in_order: bool, slot: int) -> None:
        t = time.perf_counter()
        if slot not in self.groups:
            self._prepare(slot)
        if in_order:
            self._accumulate(slot)
        with self._cv:
            self._taken.discard(slot)
            if in_order:
                self._next += 1
            self.busy_s += time.perf_counter() - t
            self._cv.notify_all()

    def _prepare(self, slot: int) -> None:
        """A landed group's old (and reference) log-probs, rewards and advantages."""
        got = self._arrived[slot]
        if got is None:
            return
        algo, r = self.cfg.algorithm, self.cfg.rollout
        n = len(got.responses)
        exp = Experience.build([got.prompt] * n, got.responses, [0.0] * n, self.pad_id)
        self.trainer.compute_logps(exp)
        reward, seq_kl = shaped_rewards(torch.tensor(got.scores, dtype=torch.float32),
                                        torch.tensor([len(x) for x in got.responses]), algo, r.max_tokens,
                                        exp.old_logp, exp.ref_logp, exp.response_mask)
        kl_sum = float(seq_kl.sum()) if seq_kl is not None else 0.0
        exp.advantages = ADV_ESTIMATORS[algo.adv_estimator](reward, torch.zeros(n, dtype=torch.long),
                                                            norm_by_std=algo.norm_adv_by_std).float()
        tokens = int(exp.response_mask.sum())
        self.groups[slot] = GroupRows(got.prompt, got.responses, exp, tokens, reward, kl_sum)

    def _accumulate(self, slot: int) -> None:
        """The group's share of the first mini-batch's gradient, if it is in it."""
        g = self.groups.get(slot)
        if g is None or slot not in self.first or not self.finite:
            return
        tr, n = self.trainer, len(g.responses)
        tr.model.train()
        # unnormalised (norm 1): the mini-batch's token count divides the gradient at the end
        self.finite = tr.accumulate_gradient(g.exp, torch.arange(n), lambda k, v, w: self.sums.append((k, v, w)),
                                             norm_tokens=1.0)
        tr.model.eval()
        self.first_tokens += g.tokens


def fill_batch(groups: list[GroupRows], pad_id: int) -> tuple[Experience, list[int]]:
    """The kept groups as one batch (in the given order) with their log-probs and advantages,
    and the first row of each group."""
    prompts, responses, starts = [], [], []
    for g in groups:
        starts.append(len(responses))
        prompts += [g.prompt] * len(g.responses)
        responses += g.responses
    batch = Experience.build(prompts, responses, [0.0] * len(responses), pad_id)
    has_old = groups[0].exp.old_logp is not None
    has_ref = groups[0].exp.ref_logp is not None
    batch.old_logp = torch.zeros_like(batch.response_mask) if has_old else None
    batch.ref_logp = torch.zeros_like(batch.response_mask) if has_ref else None
    adv = []
    for g, s in zip(groups, starts):
        e = g.exp
        k, w = e.input_ids.shape[0], e.response_mask.shape[1]  # a group is never wider than the batch
        if has_old:
            batch.old_logp[s:s + k, :w] = e.old_logp[:, :w]
        if has_ref:
            batch.ref_logp[s:s + k, :w] = e.ref_logp[:, :w]
        adv.append(e.advantages)
    batch.advantages = torch.cat(adv)
    return batch, starts


def stream_update(trainer: PolicyTrainer, streamed: StreamedUpdate, slots: list[int], step: int, seed: int,
                  mini_batches: int, epochs: int) -> dict[str, float]:
    """The update of a prompt-split step once every group is in: the first mini-batch's
    optimizer step (its gradient already accumulated), then the remaining mini-batches of the
    first PPO epoch and every mini-batch of the later ones, as :meth:`PolicyTrainer.update`.

    ``slots``: the kept slots, in batch order. Returns the update's metrics."""
    if not slots:
        return {}
    groups = [streamed.groups[s] for s in slots]
    batch, starts = fill_batch(groups, streamed.pad_id)
    rows_of = {s: list(range(starts[i], starts[i] + groups[i].exp.input_ids.shape[0])) for i, s in enumerate(slots)}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}

    def acc(k: str, v: float, w: float = 1.0) -> None:
        sums[k] = sums.get(k, 0.0) + v * w
        counts[k] = counts.get(k, 0.0) + w

    for k, v, w in streamed.sums:
        acc(k, v, w)
    trainer.model.train()
    kept = set(slots)
    for epoch in range(epochs):
        for i, mb in enumerate(prompt_minibatches(len(streamed.order), mini_batches, seed, step, epoch)):
            mb = [s for s in mb if s in kept]
            if epoch == 0 and i == 0:
                if streamed.first_tokens:
                    scale = 1.0 / streamed.first_tokens
                    for p in trainer.model.parameters():
                        if p.grad is not None:
                            p.grad.mul_(scale)
                    trainer.optimizer_step(streamed.finite, step, acc)
                continue
            if not mb:
                continue
            trainer.optimizer.zero_grad(set_to_none=True)
            idx = torch.tensor([r for s in mb for r in rows_of[s]], dtype=torch.long)
            trainer.optimizer_step(trainer.accumulate_gradient(batch, idx, acc), step, acc)
    trainer.model.eval()
    out = {k: sums[k] / counts[k] for k in sums if counts[k] > 0}
    out["actor/lr"] = trainer.scheduler.get_last_lr()[0]
    return out


def processing_order(predicted: list[float | None], num_slots: int, seed: int, step: int) -> list[int]:
    """Slots by predicted length (no history: the batch's median), ties by the slot's draw."""
    known = sorted(p for p in predicted if p is not None)
    mid = known[len(known) // 2] if known else 0.0
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 7919 + 104729)
    tie = torch.randperm(num_slots, generator=g).tolist()
    return sorted(range(num_slots), key=lambda s: (predicted[s] if predicted[s] is not None else mid, tie[s]))


__all__ = ["StreamedUpdate", "GroupRows", "prompt_minibatches", "processing_order",
           "stream_update", "fill_batch"]


def streamed_update_for(trainer: PolicyTrainer, cfg: Any, pad_id: int, step: int, predicted: list[float | None],
                        threads: int) -> StreamedUpdate:
    """The prompt split's update work for step ``step``'s groups (streamed into the rollout with
    ``trainer.stream_update``, on ``threads`` cores, or run after it)."""
    P = len(predicted)
    first = prompt_minibatches(P, cfg.trainer.ppo_mini_batches, cfg.seed, step, 0)[0]
    return StreamedUpdate(trainer, cfg, pad_id, processing_order(predicted, P, cfg.seed, step), set(first),
                          background=cfg.trainer.stream_update, threads=threads if cfg.trainer.stream_update else 0)


def finish_prompt_split(trainer: PolicyTrainer, batch: ScoredRollout, kept_outs: list, step: int,
                        cfg: Any) -> UpdateResult:
    """The update of a prompt-split step: the work already done on each group as it landed
    (streamed) is finished, then the optimizer steps on the groups the filter kept."""
    streamed = batch.streamed
    res = UpdateResult()
    t = time.perf_counter()
    streamed.finish()
    res.old_s = time.perf_counter() - t
    slot_of = {id(o): i for i, o in enumerate(batch.outs)}
    slots = [slot_of[id(o)] for o in kept_outs]
    t = time.perf_counter()
    res.metrics.update(stream_update(trainer, streamed, slots, step, cfg.seed, cfg.trainer.ppo_mini_batches,
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
