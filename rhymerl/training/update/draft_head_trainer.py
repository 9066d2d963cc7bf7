"""Online training of a draft head (:mod:`rhymerl.drafting.draft_head`) during RL.

The trainer's forward over each micro-batch already computes the policy's final hidden states;
a forward hook on the decoder's last norm keeps them (detached), and the head learns, from
position ``t``'s state and token ``t+1``, to predict token ``t+2``, and one step further from
its own output (as it drafts). The policy's embeddings and LM head are read, not trained.
No extra policy forward; the head's loss never reaches the policy's gradients.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from rhymerl.drafting.draft_head import PREFIX, DraftHead, load_head, new_head, save_head
from rhymerl.training.update.online_head import OnlineHead

HEAD_DIR = "draft_head"


class DraftHeadTrainer(OnlineHead):
    def __init__(self, policy: torch.nn.Module, lr: float, device: torch.device, seed: int = 0,
                 head: DraftHead | None = None) -> None:
        self.policy = policy
        self.head = (head or new_head(policy.config, seed)).to(device=device, dtype=torch.float32)
        self.optimizer = torch.optim.Adam(self.head.parameters(), lr=lr)
        self._hidden: torch.Tensor | None = None
        policy.model.norm.register_forward_hook(self._keep)

    def _keep(self, module, inputs, output) -> None:
        if self._on:
            self._hidden = output.detach()

    def named(self) -> dict[str, torch.Tensor]:
        """The head's weights as the rollout workers receive them."""
        return {PREFIX + n: p for n, p in self.head.named_parameters()}

    def train_on(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float]:
        """One optimizer step on the micro-batch whose policy forward just ran.

        ``ids [b, W]``; ``mask [b, W-1]`` marks response tokens (``mask[:, t]``: token ``t+1``).
        Returns (loss summed over tokens, next-token accuracy summed, tokens)."""
        h = self._hidden
        self._hidden = None
        if h is None or ids.shape[1] < 4:
            return 0.0, 0.0, 0.0
        h = h.float()
        emb = self.policy.model.embed_tokens.weight.detach().float()
        out_w = self.policy.lm_head.weight.detach().float()
        W = ids.shape[1]
        # step 1: state t and token t+1 -> token t+2, for t in 0..W-3
        e1 = F.embedding(ids[:, 1:W - 1], emb)
        h1 = self.head(h[:, : W - 2], e1)
        m1 = mask[:, 1:W - 1].float()
        logits1 = F.linear(h1, out_w)
        tgt1 = ids[:, 2:W]
        ce1 = F.cross_entropy(logits1.reshape(-1, logits1.shape[-1]), tgt1.reshape(-1), reduction="none")
        # step 2, from the head's own state: token t+2 -> token t+3
        e2 = F.embedding(ids[:, 2:W - 1], emb)
        h2 = self.head(h1[:, : W - 3], e2)
        m2 = mask[:, 2:W - 1].float()
        logits2 = F.linear(h2, out_w)
        ce2 = F.cross_entropy(logits2.reshape(-1, logits2.shape[-1]), ids[:, 3:W].reshape(-1), reduction="none")
        n1, n2 = m1.sum().clamp(min=1), m2.sum().clamp(min=1)
        loss = (ce1 * m1.reshape(-1)).sum() / n1 + (ce2 * m2.reshape(-1)).sum() / n2
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.optimizer.step()
        with torch.no_grad():
            correct = ((logits1.argmax(-1) == tgt1).float() * m1).sum()
        ntok = float(m1.sum())
        return float((ce1 * m1.reshape(-1)).sum().detach()), float(correct), ntok

    # --- checkpoints ------------------------------------------------------------------------
    def save(self, folder: Path) -> None:
        """The head as ``LLM(speculative={"method": "draft_head", "draft_head": folder/draft_head})``
        loads it, plus its optimizer state (exact resume)."""
        save_head(self.head, folder / HEAD_DIR)
        torch.save(self.optimizer.state_dict(), folder / HEAD_DIR / "optim.pt")

    def load(self, folder: Path) -> None:
        saved = load_head(folder / HEAD_DIR, self.head.hidden_size)
        opt = torch.load(folder / HEAD_DIR / "optim.pt", weights_only=True)
        with torch.no_grad():
            for p, q in zip(self.head.parameters(), saved.parameters()):
                p.copy_(q)
        self.optimizer.load_state_dict(opt)
