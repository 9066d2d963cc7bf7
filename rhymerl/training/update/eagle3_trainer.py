"""Online training of an Eagle3 head (:mod:`rhymerl.vllm.eagle3_head`) for vLLM during RL.

The trainer's forward over each micro-batch already runs the policy; forward pre-hooks on the
three layers the head reads keep the residual stream entering them (detached), and the head
learns, from those states at position ``t`` and token ``t+1``'s embedding, to predict token
``t+2``. The policy's embedding is read, not trained (vLLM shares it with the head); the head's
loss never reaches the policy's gradients. Its weights go to the vLLM engines with every policy
sync under the names ``eagle3.*`` (:data:`PREFIX`), so the drafter never runs on a stale head.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from rhymerl.vllm.eagle3_head import PREFIX, Eagle3Head, aux_layers, new_head, write_head
from rhymerl.training.update.online_head import OnlineHead

HEAD_DIR = "eagle3_head"
STEP_DECAY = 0.8


class Eagle3Trainer(OnlineHead):
    def __init__(self, policy: torch.nn.Module, target: str | Path, lr: float, device: torch.device,
                 seed: int = 0, steps: int = 1) -> None:
        self.policy, self.target = policy, target  # target: the policy's folder (the head's config follows it)
        self.steps = steps  # draft steps trained: as many as vLLM drafts (num_speculative_tokens)
        # A fresh head with its own lm_head: one equal to the policy's would be merged into the
        # policy's by vLLM at load, and a push of the head's would then overwrite the policy's.
        self.head: Eagle3Head = new_head(policy.config, seed).to(device=device, dtype=torch.float32)
        self.optimizer = torch.optim.Adam(self.head.parameters(), lr=lr)
        self.layers = aux_layers(policy.config.num_hidden_layers)
        self._states: dict[int, torch.Tensor] = {}
        for i in self.layers:
            policy.model.layers[i].register_forward_pre_hook(self._keeper(i))

    def _keeper(self, i: int):
        def keep(module, args) -> None:
            if self._on:
                self._states[i] = args[0].detach()
        return keep

    def named(self) -> dict[str, torch.Tensor]:
        """The head's weights as the rollout workers receive them."""
        return {PREFIX + n: p for n, p in self.head.state_dict().items()}

    def draft_logits(self, ids: torch.Tensor) -> list[torch.Tensor] | None:
        """Each draft step's logits (:meth:`Eagle3Head.forward`) over ``ids [b, W]`` from the states
        the last watched policy forward kept (consumed); ``None`` without them."""
        states, self._states = self._states, {}
        W = ids.shape[1]
        if len(states) != len(self.layers) or W < 3:
            return None
        aux = torch.cat([states[i][:, : W - 2].float() for i in self.layers], -1)
        embeds = F.embedding(ids[:, 1: W - 1], self.policy.model.embed_tokens.weight.detach().float())
        positions = torch.arange(W - 2, device=ids.device).expand(ids.shape[0], -1)
        cos, sin = self.policy.model.rotary_emb(positions, torch.float32)
        return self.head(aux, embeds, cos, sin, steps=self.steps)

    def train_on(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float]:
        """One optimizer step on the micro-batch whose policy forward just ran.

        ``ids [b, W]`` (positions ``0..W-1``); ``mask [b, W-1]`` marks response tokens
        (``mask[:, t]``: token ``t+1``). Returns the first draft step's (loss summed over tokens,
        top-1 hits, tokens); every step up to ``steps`` is trained."""
        step_logits = self.draft_logits(ids)
        if step_logits is None:
            return 0.0, 0.0, 0.0
        target, m = ids[:, 2:], mask[:, 1:].float()
        loss, first_loss = 0.0, 0.0
        for s, logits in enumerate(step_logits):
            ms = m.clone()
            ms[:, :s] = 0  # step s+1 drafts at t >= s only (it continues a chain begun s positions earlier)
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
            ce = ce.view_as(ms) * ms
            if s == 0:
                first_loss = float(ce.sum().detach())
            # A later step's draft counts only once the earlier ones are accepted: it weighs less.
            loss = loss + STEP_DECAY ** s * ce.sum() / ms.sum().clamp(min=1)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.optimizer.step()
        with torch.no_grad():
            correct = ((step_logits[0].argmax(-1) == target).float() * m).sum()
        return first_loss, float(correct), float(m.sum())

    # --- checkpoints ------------------------------------------------------------------------
    def save(self, folder: Path) -> Path:
        """The head as vLLM loads it (``speculative.draft_model=folder/eagle3_head``), plus its
        optimizer state (exact resume)."""
        out = write_head(self.target, folder / HEAD_DIR, weights=self.head.state_dict())
        torch.save(self.optimizer.state_dict(), out / "optim.pt")
        return out

    def load(self, folder: Path) -> None:
        from safetensors.torch import load_file

        self.head.load_state_dict(load_file(str(folder / HEAD_DIR / "model.safetensors")))
        self.optimizer.load_state_dict(torch.load(folder / HEAD_DIR / "optim.pt", weights_only=True))
