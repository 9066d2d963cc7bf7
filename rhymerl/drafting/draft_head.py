"""Draft source: a small head on the target's last hidden state (MTP/Eagle-style).

Given the target's final hidden state ``h_t`` at the position that drew token ``x_{t+1}``, the
head maps ``(h_t, embed(x_{t+1}))`` to a hidden state ``ĥ_{t+1}`` in the same space; the
target's own LM head turns it into a distribution over ``x_{t+2}``, and the head continues
from ``(ĥ_{t+1}, x_{t+2})``. It shares the target's embeddings and LM head and has no
attention, so it needs no KV cache: drafting ``k`` tokens for a batch is ``k`` small batched
matmuls. It drafts coupled to the target's sampler like the draft model
(:mod:`rhymerl.drafting.draft_model`).

The head is trained online during RL (:mod:`rhymerl.training.update.draft_head_trainer`) on the
hidden states the trainer's forward computes anyway, and pushed to the rollout workers with
the policy's weights under the names ``draft_head.*``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rhymerl.drafting.coupled import candidates, draw, sampling_rows
from rhymerl.drafting.source import Candidate, DraftSource, SourceContext, register_source
from rhymerl.engine.sequence import Sequence
from rhymerl.model.llama import RMSNorm

PREFIX = "draft_head."


class DraftHead(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size, self.eps = hidden_size, intermediate_size, eps
        self.norm_h = RMSNorm(hidden_size, eps)
        self.norm_e = RMSNorm(hidden_size, eps)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.mlp_norm = RMSNorm(hidden_size, eps)
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.out_norm = RMSNorm(hidden_size, eps)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The next hidden state from a hidden state ``h`` and the next token's embedding ``e``."""
        x = self.fc(torch.cat([self.norm_h(h), self.norm_e(e)], -1))
        gate, up = self.gate_up(self.mlp_norm(x)).split(self.intermediate_size, -1)
        return self.out_norm(x + self.down(F.silu(gate) * up))

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=g) * std)

    def config(self) -> dict:
        return {"hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size, "eps": self.eps}


def new_head(target_config, seed: int = 0) -> DraftHead:
    """A fresh head sized for a target (half its MLP width)."""
    head = DraftHead(target_config.hidden_size, max(16, target_config.intermediate_size // 2),
                     target_config.rms_norm_eps)
    head.init_weights(seed)
    return head


def save_head(head: DraftHead, folder: str | Path) -> None:
    from safetensors.torch import save_file

    from rhymerl.atomic_io import atomic_write_bytes

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(folder / "draft_head.json", json.dumps(head.config()).encode())
    save_file({k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()},
              str(folder / "draft_head.safetensors"))


def load_head(folder: str | Path, hidden_size: int | None = None) -> DraftHead:
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg_file, weights = folder / "draft_head.json", folder / "draft_head.safetensors"
    if not cfg_file.exists() or not weights.exists():
        raise ValueError(f"speculative.draft_head={folder}: no draft_head.json and draft_head.safetensors there")
    cfg = json.loads(cfg_file.read_text())
    if hidden_size is not None and cfg["hidden_size"] != hidden_size:
        raise ValueError(f"speculative.draft_head={folder}: made for hidden size {cfg['hidden_size']}, "
                         f"the target's is {hidden_size}")
    head = DraftHead(cfg["hidden_size"], cfg["intermediate_size"], cfg["eps"])
    head.load_state_dict(load_file(str(weights)))
    return head


@register_source("draft_head")
class DraftHeadSource(DraftSource):
    wants_hidden = True
    runs_a_model = True

    def __init__(self, ctx: SourceContext, head: DraftHead | None = None) -> None:
        cfg, target = ctx.cfg, ctx.target
        if target is None:
            raise ValueError("speculative: the draft_head source needs the target model (build it through LLM)")
        if head is None:
            head = load_head(cfg.draft_head, target.config.hidden_size) if cfg.draft_head \
                else new_head(target.config)  # trained online, pushed with the policy's weights
        p = next(target.parameters())
        self.head = head.to(device=p.device, dtype=p.dtype).eval()
        self.target = target
        self.k = cfg.model_draft_tokens  # >= 1: SpecConfig.from_mapping and the run config check it
        self.coupled = cfg.coupled
        self.trees = cfg.tree_budget > 0
        self.max_nodes = 2 * self.k if self.trees else self.k

    @torch.no_grad()
    def load_state(self, named: dict[str, torch.Tensor]) -> None:
        params = dict(self.head.named_parameters())
        for name, t in named.items():
            if name.startswith(PREFIX) and name[len(PREFIX):] in params:
                p = params[name[len(PREFIX):]]
                p.copy_(t.to(device=p.device, dtype=p.dtype).view_as(p))

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], caps: list[int], rows: list[int]) -> dict[int, Candidate]:
        rows = [i for i in rows if seqs[i].hidden is not None]
        if not rows:
            return {}
        sub = [seqs[i] for i in rows]
        k = min(self.k, max(caps[i] for i in rows))
        dev = self.head.fc.weight.device
        h = torch.stack([s.hidden for s in sub]).to(dev)
        tok = torch.tensor([s.last_token for s in sub], device=dev)
        params = sampling_rows(sub, dev)
        out_pos = torch.tensor([len(s.output_ids) for s in sub], device=dev)
        embed, lm_head = self.target.model.embed_tokens, self.target.lm_head
        draws = []
        for j in range(k):
            h = self.head(h, embed(tok))
            draws.append(draw(lm_head(h), params, out_pos + j, self.coupled))
            tok = draws[-1][0]
        return candidates(self.name, rows, caps, k, draws, self.trees)
