"""The policy update of one RL step: old log-probs, PPO epochs over mini-batches, micro-batches."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from rhymerl.config import AlgorithmSection, TrainerSection
from rhymerl.model import CausalLM
from rhymerl.training.algos import POLICY_LOSSES, aggregate, entropy_from_logits, kl_penalty

log = logging.getLogger(__name__)


@dataclass
class Experience:
    """One RL step's training data (what crosses from rollout to trainer)."""

    input_ids: torch.Tensor  # [N, T] prompt + response, right-padded
    response_mask: torch.Tensor  # [N, T-1] 1 where position t predicts a response token t+1
    advantages: torch.Tensor  # [N]
    old_logp: torch.Tensor | None = None  # [N, T-1]
    ref_logp: torch.Tensor | None = None  # [N, T-1]

    @staticmethod
    def build(prompts: list[list[int]], responses: list[list[int]], advantages: list[float],
              pad_id: int) -> "Experience":
        T = max(len(p) + len(r) for p, r in zip(prompts, responses))
        ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), T - 1)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            mask[i, len(p) - 1: len(p) + len(r) - 1] = 1.0
        return Experience(ids, mask, torch.tensor(advantages, dtype=torch.float32))


def lr_lambda(trainer: TrainerSection, total_steps: int):
    def f(step: int) -> float:
        if trainer.warmup_steps and step < trainer.warmup_steps:
            return (step + 1) / trainer.warmup_steps
        if trainer.lr_schedule == "cosine":
            frac = (step - trainer.warmup_steps) / max(1, total_steps - trainer.warmup_steps)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
        return 1.0
    return f


class PolicyTrainer:
    def __init__(self, model: CausalLM, trainer: TrainerSection, algo: AlgorithmSection, device: torch.device,
                 ref_model: CausalLM | None = None, total_optimizer_steps: int = 1,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1) -> None:
        self.model, self.cfg, self.algo, self.device, self.ref = model, trainer, algo, device, ref_model
        # Log-probs are those of the distribution the rollout sampled from (logits / T, then
        # top-k and top-p, renormalised): the engine's own function computes them, so the
        # gradient is taken for the policy that was sampled (verl uses logits / T alone).
        self.temperature = temperature if temperature > 0 else 1.0
        self.top_p, self.top_k = top_p, top_k
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=trainer.lr, weight_decay=trainer.weight_decay,
                                           betas=(0.9, 0.999), eps=1e-8)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lr_lambda(trainer, total_optimizer_steps))
        self.bad_steps = 0

    def _token_logp(self, model: CausalLM, ids: torch.Tensor, with_entropy: bool = False):
        raw = model(ids)[:, :-1].float()
        logits = raw / self.temperature
        if self.top_p < 1.0 or self.top_k > 0:
            from rhymerl.engine.sampler import sampling_logprobs

            B, T, V = raw.shape
            rows = B * T
            full = sampling_logprobs(raw.reshape(rows, V), torch.full((rows,), self.temperature, device=raw.device),
                                     torch.full((rows,), self.top_p, device=raw.device),
                                     torch.full((rows,), self.top_k, device=raw.device, dtype=torch.long))
            # Tokens outside top-k/top-p have log-prob -inf; only padding positions hold them
            # (the rollout never samples one), and the floor keeps 0 x -inf out of the loss.
            logp = full.reshape(B, T, V).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1).clamp(min=-1e4)
        else:
            logp = logits.log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        return (logp, entropy_from_logits(logits)) if with_entropy else (logp, None)

    @property
    def single_update(self) -> bool:
        """One optimizer step per rollout: the sampling policy is the one being updated."""
        return self.cfg.ppo_epochs * self.cfg.ppo_mini_batches == 1

    @property
    def needs_old_logp(self) -> bool:
        """Old log-probs are needed by several updates per rollout, or by a KL in the reward."""
        return not self.single_update or (self.ref is not None and self.algo.use_kl_in_reward)

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
        for micro in self._micro_batches(exp, torch.arange(N)):
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

    @staticmethod
    def _width(exp: Experience, micro: torch.Tensor) -> int:
        return int(exp.response_mask[micro].nonzero()[:, 1].max()) + 2

    def update(self, exp: Experience, step: int, seed: int) -> dict[str, float]:
        """PPO epochs x mini-batches, each an optimizer step over accumulated micro-batches."""
        assert exp.old_logp is not None or self.single_update
        self.model.train()
        N = exp.input_ids.shape[0]
        algo, loss_fn = self.algo, POLICY_LOSSES[self.algo.policy_loss]
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}

        def acc(k: str, v: float) -> None:
            sums[k] = sums.get(k, 0.0) + v
            counts[k] = counts.get(k, 0) + 1

        for _ in range(self.cfg.ppo_epochs):
            order = torch.randperm(N, generator=g)
            for mb_idx in order.chunk(self.cfg.ppo_mini_batches):
                norm_tokens = float(exp.response_mask[mb_idx].sum().clamp(min=1))
                norm_seqs = float(len(mb_idx))
                self.optimizer.zero_grad(set_to_none=True)
                finite = True
                for micro in self._micro_batches(exp, mb_idx):
                    width = self._width(exp, micro)  # trim padding shared by the whole micro-batch
                    ids = exp.input_ids[micro, :width].to(self.device)
                    mask = exp.response_mask[micro][:, : width - 1].to(self.device)
                    adv = exp.advantages[micro].to(self.device).unsqueeze(1)
                    logp, ent = self._token_logp(self.model, ids, with_entropy=True)
                    old = logp.detach() if exp.old_logp is None else exp.old_logp[micro][:, : width - 1].to(self.device)
                    pg_loss, m = loss_fn(logp, old, adv, mask, clip_low=algo.clip_ratio_low,
                                         clip_high=algo.clip_ratio_high, clip_c=algo.clip_ratio_c,
                                         agg=algo.loss_agg_mode, norm_tokens=norm_tokens, norm_seqs=norm_seqs)
                    ent_loss = aggregate(ent, mask, algo.loss_agg_mode, norm_tokens=norm_tokens, norm_seqs=norm_seqs)
                    loss = pg_loss - algo.entropy_coef * ent_loss
                    if self.ref is not None and algo.kl_coef > 0 and not algo.use_kl_in_reward:
                        assert exp.ref_logp is not None
                        ref = exp.ref_logp[micro][:, : width - 1].to(self.device)
                        kl = aggregate(kl_penalty(logp, ref, algo.kl_type), mask, algo.loss_agg_mode,
                                       norm_tokens=norm_tokens, norm_seqs=norm_seqs)
                        loss = loss + algo.kl_coef * kl
                        acc("actor/kl_loss", float(kl.detach()) * norm_tokens / max(1.0, float(mask.sum())))
                    if not torch.isfinite(loss):
                        finite = False
                        break
                    loss.backward()
                    frac = float(mask.sum()) / norm_tokens
                    acc("actor/pg_loss", float(pg_loss.detach()) / max(frac, 1e-9))
                    acc("actor/entropy", float((ent.detach() * mask).sum() / mask.sum().clamp(min=1)))
                    for k, v in m.items():
                        acc(f"actor/{k}", float(v))
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip) \
                    if finite else torch.tensor(float("nan"))
                if not finite or not torch.isfinite(grad_norm):
                    self.optimizer.zero_grad(set_to_none=True)
                    self.bad_steps += 1
                    log.warning("step %d: non-finite loss or gradient; update skipped (%d so far)", step,
                                self.bad_steps)
                    acc("actor/skipped_updates", 1.0)
                    if self.bad_steps > self.cfg.max_bad_steps:
                        raise FloatingPointError(f"more than trainer.max_bad_steps={self.cfg.max_bad_steps} "
                                                 "non-finite updates; aborting")
                    continue
                self.optimizer.step()
                self.scheduler.step()
                acc("actor/grad_norm", float(grad_norm))
        self.model.eval()
        out = {k: sums[k] / counts[k] for k in sums}
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        return out
