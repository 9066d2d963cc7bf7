"""The policy update of one RL step: old log-probs, PPO epochs over mini-batches, micro-batches."""
from __future__ import annotations

import contextlib
import logging
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Protocol

import torch

from rhymerl.config import AlgorithmSection, TrainerSection
from rhymerl.algos import OFFPOLICY_CORRECTIONS, POLICY_LOSSES, aggregate, entropy_from_logits, kl_penalty
from rhymerl.training.update.token_balance import balance_by_tokens

log = logging.getLogger(__name__)

TRAINER_DIR = "trainer"  # a checkpoint's sharded trainer state (torch.distributed.checkpoint)


@dataclass
class Experience:
    """One RL step's training data (what crosses from rollout to trainer)."""

    input_ids: torch.Tensor  # [N, T] prompt + response, right-padded
    response_mask: torch.Tensor  # [N, T-1] 1 where position t predicts a response token t+1
    advantages: torch.Tensor  # [N]
    old_logp: torch.Tensor | None = None  # [N, T-1]
    ref_logp: torch.Tensor | None = None  # [N, T-1]
    behav_logp: torch.Tensor | None = None  # [N, T-1] the sampling policy's, when older than the update's (async)

    @staticmethod
    def build(prompts: list[list[int]], responses: list[list[int]], advantages: list[float],
              pad_id: int, behaviour_logprobs: list[list[float]] | None = None) -> "Experience":
        T = max(len(p) + len(r) for p, r in zip(prompts, responses))
        ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), T - 1)
        behav = torch.zeros(len(prompts), T - 1) if behaviour_logprobs is not None else None
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            mask[i, len(p) - 1: len(p) + len(r) - 1] = 1.0
            if behav is not None:
                lp = behaviour_logprobs[i]  # type: ignore[index]
                if len(lp) != len(r):
                    raise ValueError(f"response {i}: {len(lp)} behaviour log-probs for {len(r)} tokens")
                behav[i, len(p) - 1: len(p) + len(r) - 1] = torch.tensor(lp)
        return Experience(ids, mask, torch.tensor(advantages, dtype=torch.float32), behav_logp=behav)


def make_optimizer(params: Any, trainer: TrainerSection) -> torch.optim.Optimizer:
    """The policy's optimizer (one definition: the trainer and a checkpoint's reader build it alike)."""
    return torch.optim.AdamW(params, lr=trainer.lr, weight_decay=trainer.weight_decay, betas=(0.9, 0.999), eps=1e-8)


def lr_lambda(trainer: TrainerSection, total_steps: int):
    def f(step: int) -> float:
        if trainer.warmup_steps and step < trainer.warmup_steps:
            return (step + 1) / trainer.warmup_steps
        if trainer.lr_schedule == "cosine":
            frac = (step - trainer.warmup_steps) / max(1, total_steps - trainer.warmup_steps)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
        return 1.0
    return f


@dataclass
class SyncStats:
    """One publication of the policy into the controller's copy (the weights the workers sync from)."""

    bytes: int
    seconds: float


class Trainer(Protocol):
    """What the RL loop asks of whoever trains the policy: :class:`PolicyTrainer` (one process)
    or :class:`~rhymerl.training.update.trainer_group.TrainerGroup` (N ranks). The loop never asks which."""

    bad_steps: int  # non-finite updates skipped so far (the run stops past trainer.max_bad_steps)
    # Runs in the controller's process: an update overlapping the rollout (async RL, a streamed
    # update) keeps to the cores the rollout workers leave.
    in_process: bool

    def compute_logps(self, exp: Experience) -> None: ...

    def update(self, exp: Experience, step: int, seed: int) -> dict[str, float]: ...

    def publish(self) -> SyncStats:
        """Bring the new weights into the controller's copy of the policy."""
        ...

    def save_state(self, folder: Path) -> None: ...

    def load_state(self, folder: Path, ranks: int) -> None:
        """Restore what ``save_state`` wrote there, written by ``ranks`` processes."""
        ...

    def close(self) -> None: ...


_MASK_ROWS = 256  # rows per block when finding the tokens top-p/top-k remove (memory, not results)


def sampling_token_logp(model_out: torch.Tensor, ids: torch.Tensor, temperature: float, top_p: float = 1.0,
                        top_k: int = -1, with_entropy: bool = False):
    """Each next token's log-probability under the distribution the rollout samples from (the
    logits ``model_out`` of ``ids`` at ``temperature``, top-p and top-k applied), and optionally
    the entropy: the trainer's log-probs and the engine check's are this one function."""
    raw = model_out[:, :-1].float()
    logits = raw / temperature
    if top_p < 1.0 or top_k > 0:
        from rhymerl.engine.sampler import removed_tokens, scaled_logits

        B, T, V = raw.shape
        rows = B * T
        scaled = scaled_logits(raw.reshape(rows, V), torch.full((rows,), temperature, device=raw.device))
        # The engine's sampling distribution (sampler.sampling_logprobs, the same bits), with the
        # removed tokens found without autograd and in row blocks: the sort behind top-p over a
        # real vocabulary would otherwise hold several copies of [rows, V] for the backward.
        remove = torch.empty(rows, V, dtype=torch.bool, device=raw.device)
        with torch.no_grad():
            for i in range(0, rows, _MASK_ROWS):
                j = min(rows, i + _MASK_ROWS)
                remove[i:j] = removed_tokens(scaled[i:j], torch.full((j - i,), top_p, device=raw.device),
                                             torch.full((j - i,), top_k, device=raw.device, dtype=torch.long))
        full = scaled.masked_fill(remove, float("-inf")).log_softmax(-1)
        # Tokens outside top-k/top-p have log-prob -inf; only padding positions hold them
        # (the rollout never samples one), and the floor keeps 0 x -inf out of the loss.
        logp = full.reshape(B, T, V).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1).clamp(min=-1e4)
    else:
        logp = logits.log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (logp, entropy_from_logits(logits)) if with_entropy else (logp, None)


class PolicyTrainer:
    """The update on one process. With ``world_size > 1`` this is one rank of a data-parallel
    group (``rhymerl.training.update.rank``): ``model`` is already wrapped by the strategy, each
    rank takes its token-balanced part of every mini-batch, the loss keeps the global batch's
    normaliser, so the summed gradient is one process's up to float summation order."""

    in_process = True  # meets Trainer: updates the controller's own model

    def __init__(self, model: torch.nn.Module, trainer: TrainerSection, algo: AlgorithmSection, device: torch.device,
                 ref_model: torch.nn.Module | None = None, total_optimizer_steps: int = 1,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, *,
                 rank: int = 0, world_size: int = 1,
                 grad_sync: Callable[[bool], ContextManager[None]] | None = None, draft_head=None) -> None:
        self.model, self.cfg, self.algo, self.device, self.ref = model, trainer, algo, device, ref_model
        self.rank, self.world_size = rank, world_size
        # grad_sync(last) wraps a micro-batch's backward: gradients are reduced across ranks
        # only on a mini-batch's last one (DDP's no_sync, FSDP2's set_requires_gradient_sync).
        self.grad_sync = grad_sync or (lambda last: contextlib.nullcontext())
        # Log-probs are those of the distribution the rollout sampled from (logits / T, then
        # top-k and top-p, renormalised): the engine's own function computes them, so the
        # gradient is taken for the policy that was sampled (verl uses logits / T alone).
        self.temperature = temperature if temperature > 0 else 1.0
        self.top_p, self.top_k = top_p, top_k
        self.optimizer = make_optimizer(model.parameters(), trainer)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lr_lambda(trainer, total_optimizer_steps))
        self.bad_steps = 0
        # A draft head trained online on this trainer's hidden states (DraftHeadTrainer), or None.
        self.draft_head = draft_head

    def _token_logp(self, model: torch.nn.Module, ids: torch.Tensor, with_entropy: bool = False):
        return sampling_token_logp(model(ids), ids, self.temperature, self.top_p, self.top_k, with_entropy)

    @property
    def single_update(self) -> bool:
        """One optimizer step per rollout: the sampling policy is the one being updated."""
        return self.cfg.ppo_epochs * self.cfg.ppo_mini_batches == 1

    @property
    def needs_old_logp(self) -> bool:
        """Old log-probs are needed by several updates per rollout, or by a KL in the reward."""
        return not self.single_update or (self.ref is not None and self.algo.use_kl_in_reward) \
            or self.cfg.async_staleness > 0  # async: decoupled PPO's proximal policy

    @torch.no_grad()
    def compute_logps(self, exp: Experience) -> None:
        """Old (and reference) log-probs, recomputed by the trainer as verl does.

        With a single update per rollout the old policy *is* the current one, so the loss
        uses the detached current log-probs instead (the same gradient, one forward less).
        """
        self.model.eval()
        N, W = exp.response_mask.shape
        exp.old_logp = torch.zeros(N, W) if self.needs_old_logp else None
        exp.ref_logp = torch.zeros(N, W) if self.ref is not None else None
        if exp.old_logp is None and exp.ref_logp is None:
            return
        for micro in self._rank_micro_batches(exp, torch.arange(N)):
            if micro is None:  # this rank's part is done; the others' forwards still need it (FSDP)
                ids = exp.input_ids[:1, :2].to(self.device)
                if exp.old_logp is not None:
                    self._token_logp(self.model, ids)
                if exp.ref_logp is not None:
                    self._token_logp(self.ref, ids)
                continue
            width = self._width(exp, micro)
            ids = exp.input_ids[micro, :width].to(self.device)
            if exp.old_logp is not None:
                exp.old_logp[micro, : width - 1] = self._token_logp(self.model, ids)[0].cpu()
            if exp.ref_logp is not None:
                exp.ref_logp[micro, : width - 1] = self._token_logp(self.ref, ids)[0].cpu()

    def _micro_batches(self, exp: Experience, idx: torch.Tensor) -> list[torch.Tensor]:
        """Micro-batches of similar length (less padding); the order is deterministic.

        With ``micro_batch_tokens`` (verl's dynamic batch size), a micro-batch takes sequences
        in length order while its padded size (count x longest) stays within that many tokens,
        and at most ``micro_batch_size`` of them: short sequences go many to a micro-batch,
        long ones few, instead of every micro-batch being padded to its own longest.
        """
        mask = exp.response_mask[idx]
        lengths = mask.sum(-1) + mask.argmax(-1)  # prompt + response tokens
        sort = torch.sort(lengths, stable=True)
        order = idx[sort.indices]
        budget, cap = self.cfg.micro_batch_tokens, self.cfg.micro_batch_size
        if budget <= 0:
            return list(order.split(cap))
        out: list[torch.Tensor] = []
        start = 0
        for i, n in enumerate(sort.values.tolist()):
            count = i - start + 1
            if count > 1 and (count > cap or count * (n + 1) > budget):
                out.append(order[start:i])
                start = i
        out.append(order[start:])
        return out

    def rank_parts(self, exp: Experience, idx: torch.Tensor) -> list[torch.Tensor]:
        """``idx`` split over the ranks, balanced by tokens: a function of the lengths alone, so
        every rank knows every rank's part without talking."""
        if self.world_size == 1:
            return [idx]
        parts = balance_by_tokens(exp.response_mask[idx].sum(-1).tolist(), self.world_size)
        return [idx[torch.tensor(p, dtype=torch.long)] for p in parts]

    def _rank_micro_batches(self, exp: Experience, idx: torch.Tensor) -> list[torch.Tensor | None]:
        """This rank's micro-batches of ``idx``, padded with ``None`` to the most any rank has:
        FSDP's forward and backward are collectives, so every rank runs as many."""
        if self.world_size == 1:
            return list(self._micro_batches(exp, idx))
        per_rank = [self._micro_batches(exp, p) if len(p) else [] for p in self.rank_parts(exp, idx)]
        most = max(len(m) for m in per_rank)
        mine: list[torch.Tensor | None] = list(per_rank[self.rank])
        return mine + [None] * (most - len(mine))

    @staticmethod
    def _width(exp: Experience, micro: torch.Tensor) -> int:
        return int(exp.response_mask[micro].nonzero()[:, 1].max()) + 2

    def update(self, exp: Experience, step: int, seed: int) -> dict[str, float]:
        """PPO epochs x mini-batches, each an optimizer step over accumulated micro-batches."""
        sums, counts, lr = self.update_sums(exp, step, seed)
        out = {k: sums[k] / counts[k] for k in sums if counts[k] > 0}
        out["actor/lr"] = lr
        return out

    def update_sums(self, exp: Experience, step: int, seed: int) -> tuple[dict[str, float], dict[str, float], float]:
        """:meth:`update`, its metrics as weighted sums and weights (a group of ranks adds them up).

        Each metric is weighted by what it averages over (tokens, or the mini-batch), so its
        value does not depend on how a mini-batch is cut into micro-batches or ranks."""
        assert exp.old_logp is not None or self.single_update
        self.model.train()
        N = exp.input_ids.shape[0]
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}

        def acc(k: str, v: float, w: float = 1.0) -> None:
            sums[k] = sums.get(k, 0.0) + v * w
            counts[k] = counts.get(k, 0.0) + w

        for _ in range(self.cfg.ppo_epochs):
            order = torch.randperm(N, generator=g)
            for mb_idx in order.chunk(self.cfg.ppo_mini_batches):
                self.optimizer.zero_grad(set_to_none=True)
                self.optimizer_step(self.accumulate_gradient(exp, mb_idx, acc), step, acc)
        self.model.eval()
        return sums, counts, self.scheduler.get_last_lr()[0]

    def optimizer_step(self, finite: bool, step: int, acc: Callable[[str, float, float], None]) -> None:
        """Clip the accumulated gradient to the global norm and step, or skip the step (counted)
        when the loss or the gradient is not finite."""
        if not finite:
            grad_norm = torch.tensor(float("nan"))
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            if hasattr(grad_norm, "full_tensor"):  # FSDP2: the global norm, as a DTensor
                grad_norm = grad_norm.full_tensor()
        if not finite or not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.bad_steps += 1
            if self.rank == 0:
                log.warning("step %d: non-finite loss or gradient; update skipped (%d so far)", step, self.bad_steps)
            acc("actor/skipped_updates", 1.0, 1.0)
            if self.bad_steps > self.cfg.max_bad_steps:
                raise FloatingPointError(f"more than trainer.max_bad_steps={self.cfg.max_bad_steps} "
                                         "non-finite updates; aborting")
            return
        self.optimizer.step()
        self.scheduler.step()
        acc("actor/grad_norm", float(grad_norm), 1.0)

    def accumulate_gradient(self, exp: Experience, mb_idx: torch.Tensor,
                            acc: Callable[[str, float, float], None] = lambda k, v, w: None,
                            norm_tokens: float | None = None) -> bool:
        """Backward over one mini-batch's micro-batches (this rank's part of them); whether
        every loss was finite, agreed by all ranks (so all of them skip, or none).

        ``norm_tokens``: the token-mean's denominator, when ``mb_idx`` is only part of the
        mini-batch (a streamed update passes 1 and divides the gradient at the end)."""
        # The global mini-batch's normalisers on every rank, and the reduction's average over
        # ranks undone: the ranks' gradients add up to one process's.
        if norm_tokens is None:
            norm_tokens = float(exp.response_mask[mb_idx].sum().clamp(min=1))
        norm_seqs = float(len(mb_idx))
        scale = float(self.world_size)
        micros = self._rank_micro_batches(exp, mb_idx)
        finite = True
        for i, micro in enumerate(micros):
            with self.grad_sync(i == len(micros) - 1):
                if micro is None:  # padding for the collectives: a zero contribution
                    self._token_logp(self.model, exp.input_ids[:1, :2].to(self.device))[0].sum().mul(0.0).backward()
                    continue
                width = self._width(exp, micro)  # trim padding shared by the whole micro-batch
                ids = exp.input_ids[micro, :width].to(self.device)
                mask = exp.response_mask[micro][:, : width - 1].to(self.device)
                ntok = float(mask.sum())
                with self.draft_head.watching() if self.draft_head is not None else contextlib.nullcontext():
                    logp, ent = self._token_logp(self.model, ids, with_entropy=True)
                if self.draft_head is not None:
                    d_loss, d_correct, d_tok = self.draft_head.train_on(ids, mask)
                    if d_tok:
                        acc("draft/loss", d_loss / d_tok, d_tok)
                        acc("draft/top1", d_correct / d_tok, d_tok)
                loss, pg_loss, m = self._micro_loss(exp, micro, width, logp, ent, mask, norm_tokens, norm_seqs, acc)
                if not torch.isfinite(loss):
                    finite = False
                    if self.world_size == 1:
                        break
                    logp.sum().mul(0.0).backward()  # the other ranks' collectives still need a backward
                    continue
                (loss * scale if scale != 1.0 else loss).backward()
                # token-weighted, like the other update metrics (and the same whether the
                # mini-batch's normaliser was applied here or after a streamed accumulation)
                acc("actor/pg_loss", float(pg_loss.detach()) * norm_tokens / max(1.0, ntok), ntok)
                acc("actor/entropy", float((ent.detach() * mask).sum() / mask.sum().clamp(min=1)), ntok)
                for k, v in m.items():  # token means over the micro-batch
                    acc(f"actor/{k}", float(v), ntok)
        if self.world_size > 1:
            import torch.distributed as dist

            flag = torch.tensor([1.0 if finite else 0.0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            finite = bool(flag.item() == 1.0)
        return finite

    def _micro_loss(self, exp: Experience, micro: Any, width: int, logp: torch.Tensor, ent: torch.Tensor,
                    mask: torch.Tensor, norm_tokens: float, norm_seqs: float,
                    acc: Callable[[str, float, float], None]) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """One micro-batch's loss (policy gradient, entropy bonus, KL penalty) over its
        mini-batch's normalisers; returns (loss, pg_loss, the policy loss's metrics)."""
        algo = self.algo
        adv = exp.advantages[micro].to(self.device).unsqueeze(1)
        old = logp.detach() if exp.old_logp is None else exp.old_logp[micro][:, : width - 1].to(self.device)
        if exp.behav_logp is not None:
            # Drawn by an older policy: the correction says what the loss clips around
            # and how each token is weighted (the PPO loss is linear in the weight).
            behav = exp.behav_logp[micro][:, : width - 1].to(self.device)
            corr = OFFPOLICY_CORRECTIONS[algo.offpolicy_correction](old, behav, cap=algo.is_cap)
            old, adv = corr.anchor, adv * corr.weights
        pg_loss, m = POLICY_LOSSES[algo.policy_loss](logp, old, adv, mask, clip_low=algo.clip_ratio_low,
                                                     clip_high=algo.clip_ratio_high, clip_c=algo.clip_ratio_c,
                                                     agg=algo.loss_agg_mode, norm_tokens=norm_tokens,
                                                     norm_seqs=norm_seqs)
        ent_loss = aggregate(ent, mask, algo.loss_agg_mode, norm_tokens=norm_tokens, norm_seqs=norm_seqs)
        loss = pg_loss - algo.entropy_coef * ent_loss
        if self.ref is not None and algo.kl_coef > 0 and not algo.use_kl_in_reward:
            assert exp.ref_logp is not None
            ref = exp.ref_logp[micro][:, : width - 1].to(self.device)
            kl = aggregate(kl_penalty(logp, ref, algo.kl_type), mask, algo.loss_agg_mode,
                           norm_tokens=norm_tokens, norm_seqs=norm_seqs)
            loss = loss + algo.kl_coef * kl
            ntok = float(mask.sum())
            acc("actor/kl_loss", float(kl.detach()) * norm_tokens / max(1.0, ntok), ntok)
        return loss, pg_loss, m

    # --- state in checkpoints -------------------------------------------------------------------
    def publish(self) -> SyncStats:
        """Nothing to move: this trainer updates the controller's model in place."""
        return SyncStats(0, 0.0)

    def close(self) -> None:
        """Nothing to stop (meets :class:`Trainer`)."""

    def save_state(self, folder: Path) -> None:
        """Optimizer and scheduler state into a checkpoint folder being written.

        One process writes ``optim.pt``; a group of ranks writes ``trainer/``, a
        ``torch.distributed.checkpoint`` of the model and optimizer (each rank its shard,
        keyed by parameter name, so another world size can read it back) and ``scheduler.pt``.
        """
        if self.draft_head is not None:
            self.draft_head.save(folder)
        if self.world_size == 1:
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                       folder / "optim.pt")
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder / TRAINER_DIR)
        if self.rank == 0:
            torch.save({"scheduler": self.scheduler.state_dict()}, folder / TRAINER_DIR / "scheduler.pt")

    def load_state(self, folder: Path, ranks: int = 1) -> None:
        """Restore what :meth:`save_state` wrote, written by ``ranks`` processes, whatever world
        size reads it (resharded by ``torch.distributed.checkpoint``). One writer's ``optim.pt``
        is read with the weights-only loader; the sharded reader (pickled metadata) only for
        ``ranks > 1``. Everything is read before anything is applied; a damaged file raises
        :class:`CheckpointError` naming it."""
        from torch.distributed.checkpoint.api import CheckpointException

        from rhymerl.training.checkpoint import CheckpointError

        where = folder / TRAINER_DIR if ranks > 1 else folder / "optim.pt"
        saved_opt = self.optimizer.state_dict()
        try:
            if ranks > 1:
                self._load_sharded(where)
            else:
                self._load_single(where)
            if self.draft_head is not None:
                self.draft_head.load(folder)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - any damage becomes one clear error
            # (CheckpointException derives from BaseException: a bare `except Exception` lets it through)
            try:
                self.optimizer.load_state_dict(saved_opt)
            except Exception:  # noqa: BLE001 - the model state may be half applied: the caller falls back
                pass
            raise CheckpointError(f"{where}: unreadable or not of this run ({type(e).__name__}: {e})") from e

    def _load_single(self, path: Path) -> None:
        """``optim.pt`` (written by one process), into one process or into every rank."""
        saved = torch.load(path, weights_only=True)
        if self.world_size == 1:
            self.optimizer.load_state_dict(saved["optimizer"])
            self.scheduler.load_state_dict(saved["scheduler"])
            return
        # A one-process checkpoint resumed on many ranks: rebuild its optimizer on a plain copy of
        # the checkpoint's policy, read it back keyed by parameter name, and let every rank take its part.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

        from rhymerl.model import load_pretrained

        plain = load_pretrained(path.parent / "policy", dtype=torch.float32)
        opt = make_optimizer(plain.parameters(), self.cfg)
        opt.load_state_dict(saved["optimizer"])
        msd, osd = get_state_dict(plain, opt)
        set_state_dict(self.model, self.optimizer, model_state_dict=msd, optim_state_dict=osd,
                       options=StateDictOptions(full_state_dict=True))
        self.scheduler.load_state_dict(saved["scheduler"])

    def _load_sharded(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.utils._pytree import tree_map

        sched = torch.load(folder / "scheduler.pt", weights_only=True)["scheduler"]
        msd, osd = get_state_dict(self.model, self.optimizer)
        # Read into fresh tensors, applied only once all of it has been read.
        fresh = tree_map(lambda v: torch.empty_like(v) if isinstance(v, torch.Tensor) else v,
                         {"model": msd, "optim": osd})
        with warnings.catch_warnings():
            # one process reading ranks' shards: torch says it assumes so; that is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(fresh, checkpoint_id=folder, no_dist=self.world_size == 1)
        set_state_dict(self.model, self.optimizer, model_state_dict=fresh["model"], optim_state_dict=fresh["optim"])
        self.scheduler.load_state_dict(sched)
