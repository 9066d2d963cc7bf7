"""Turns scheduled sequences into tensors, runs the model, samples and verifies.

Two kinds of forward pass:
- ``prefill``: the prompts of newly admitted requests, one row per prompt (its n samples
  then copy the prompt's K/V), returning the first token of every sample;
- ``decode``: every running sequence's last token plus, when a drafter is on, a tree of
  drafted tokens, all scored in one pass under a tree attention mask, then verified.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rhymerl.engine.acceptance import ancestors, walk_tree
from rhymerl.engine.draft import Drafts, as_batch
from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.sampler import SamplingBatch, sample
from rhymerl.engine.sequence import Sequence
from rhymerl.model import CacheView, CausalLM
from rhymerl.model.invariant import KEY_CHUNK, invariant_forward


@dataclass
class DecodeResult:
    """Per sequence: the tokens to emit (accepted drafts + one drawn token) and their log-probs."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    drafted: list[int]
    accepted: list[int]


def _sampling_batch(seqs: list[Sequence], positions: torch.Tensor, device: torch.device) -> SamplingBatch:
    """Parameters for rows laid out ``[len(seqs), K]`` (flattened), output positions given."""
    K = positions.shape[1]
    # Two tensors (float and integer columns) rather than one per parameter: this runs every step.
    f = torch.tensor([(s.params.temperature, s.params.top_p) for s in seqs], dtype=torch.float32)
    i = torch.tensor([(s.params.top_k, s.draw_key) for s in seqs], dtype=torch.long)
    f = f.repeat_interleave(K, dim=0).to(device)
    i = i.repeat_interleave(K, dim=0).to(device)
    return SamplingBatch(temperature=f[:, 0], top_p=f[:, 1], top_k=i[:, 0], key=i[:, 1],
                         position=positions.reshape(-1).to(device))


def _logical_keys(lens: torch.Tensor, anc: torch.Tensor, depth: torch.Tensor, max_depth: int,
                  kv_len: int) -> torch.Tensor:
    """``[B, T, n]``: for tree node ``t`` of row ``b``, the cache position of its logical key
    ``j`` (``n`` = ``kv_len`` rounded up to whole key chunks): ``j`` itself below the row's
    cached length ``L``, then the node's ancestor at depth ``j - L`` (stored at ``L`` + its node
    index), and ``j`` again past the node (masked there)."""
    B, T, _ = anc.shape
    dev = lens.device
    n = -(-kv_len // KEY_CHUNK) * KEY_CHUNK
    node = torch.arange(T, device=dev).view(1, 1, T).expand(B, T, T)
    dep_of = depth.unsqueeze(1).expand(B, T, T)  # depth of node s, for every t
    at_depth = torch.zeros(B, T, max_depth + 2, dtype=torch.long, device=dev)
    at_depth.scatter_(2, torch.where(anc, dep_of, torch.full_like(dep_of, max_depth + 1)), node)
    j = torch.arange(n, device=dev).view(1, 1, n)
    rel = j - lens.view(B, 1, 1)
    inside = (rel >= 0) & (rel <= depth.unsqueeze(2))
    anc_pos = lens.view(B, 1, 1) + at_depth.gather(2, rel.clamp(0, max_depth).expand(B, T, n))
    return torch.where(inside, anc_pos, j.expand(B, T, n))


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, device: torch.device, *, invariant: bool = False,
                 keep_hidden: bool = False) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.invariant = invariant
        # Keep each sequence's final hidden state at its last emitted token (a draft head reads it).
        self.keep_hidden = keep_hidden
        self.num_forwards = 0
        # last-position logits of prompts whose samples are not all admitted yet
        self.prompt_logits: dict[int, torch.Tensor] = {}
        self.prompt_hidden: dict[int, torch.Tensor] = {}  # and their hidden states (keep_hidden)
        self.reused_prompts = 0  # groups admitted without a prompt forward

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, view: CacheView,
                logits_index: torch.Tensor | None = None, key_pos: torch.Tensor | None = None,
                return_hidden: bool = False):
        """The model against the cache: the plain forward, or the shape-invariant one."""
        if self.invariant:
            return invariant_forward(self.model, ids, positions, view, logits_index, key_pos, return_hidden)
        return self.model(ids, positions, view, logits_index=logits_index, return_hidden=return_hidden)

    @torch.inference_mode()
    def prefill(self, groups: list[list[Sequence]], cached: dict[int, int] | None = None) -> None:
        """Prefill each group's shared prompt and draw every sample's first token.

        Groups occupy consecutive slots starting at ``groups[0][0].slot``; the prefill
        rows are written to the first slots of that range and then fanned out.
        ``cached`` maps a group index to the slot of a running sibling: that group's prompt
        K/V is copied from there and its first tokens drawn from the prompt's kept
        last-position logits, with no forward (siblings admitted steps after the first).
        """
        # Kept flat on purpose (over 60 lines): the engine's hot path, one forward read top to bottom.
        cached = cached or {}
        fresh = [gi for gi in range(len(groups)) if gi not in cached]
        base = groups[0][0].slot
        logits_of: dict[int, torch.Tensor] = {}
        if fresh:
            prefixes = [groups[gi][0].prefill_ids for gi in fresh]
            lens = [len(p) for p in prefixes]
            T = max(lens)
            ids = torch.zeros(len(fresh), T, dtype=torch.long)
            for i, p in enumerate(prefixes):
                ids[i, : lens[i]] = torch.tensor(p)
            ids = ids.to(self.device)
            pos = torch.arange(T, device=self.device).expand(len(fresh), T)
            causal = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
            mask = causal.expand(len(fresh), 1, T, T)
            view = self.cache.view(base, base + len(fresh), pos, mask)
            last = torch.tensor(lens, device=self.device).sub_(1).unsqueeze(1)
            logits = self.forward(ids, pos, view, logits_index=last, return_hidden=self.keep_hidden)
            if self.keep_hidden:
                logits, hidden = logits
                for i, gi in enumerate(fresh):
                    for s in groups[gi]:
                        s.hidden = hidden[i, 0]
            logits = logits[:, 0]  # [G, V]
            self.num_forwards += 1
            # Fan the prompt K/V out to every sample's slot; reverse order never overwrites a
            # prefill row before it is copied (row i is at base+i <= its group's first slot).
            for i in range(len(fresh) - 1, -1, -1):
                g = groups[fresh[i]]
                self.cache.fan_out(base + i, g[0].slot, len(g), lens[i])
            for i, gi in enumerate(fresh):
                logits_of[gi] = logits[i]
                g0 = groups[gi][0]
                if not g0.resumed:
                    self.prompt_logits[g0.request_id] = logits[i]
                    if self.keep_hidden:
                        self.prompt_hidden[g0.request_id] = groups[gi][0].hidden
        for gi, src in cached.items():  # after the fresh rows: those may have passed through these slots
            g = groups[gi]
            if self.keep_hidden:
                for s in g:
                    s.hidden = self.prompt_hidden.get(g[0].request_id)
            self.reused_prompts += 1
            self.cache.fan_out(src, g[0].slot, len(g), len(g[0].prompt_ids))
            logits_of[gi] = self.prompt_logits[g[0].request_id]
        rows = [gi for gi, g in enumerate(groups) for _ in g]
        seqs = [s for g in groups for s in g]
        batch = _sampling_batch(seqs, torch.zeros(len(seqs), 1, dtype=torch.long), self.device)
        tokens, logps = sample(torch.stack([logits_of[gi] for gi in rows]), batch)
        for s, t, lp in zip(seqs, tokens.tolist(), logps.tolist()):
            if s.resumed:  # its next token is already known: the prefill only rebuilt the K/V
                s.cache_len = len(s.prefill_ids)
                continue
            s.cache_len = len(s.prompt_ids)
            s.output_ids.append(t)
            s.logprobs.append(lp)
            s.num_forwards += 1

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], drafts: Drafts = None) -> DecodeResult:
        """One forward over all running sequences (slots ``0..B-1``) with optional draft trees."""
        # Kept flat on purpose (over 60 lines): the engine's hot path, one forward read top to bottom.
        B = len(seqs)
        dev = self.device
        batch = as_batch(drafts)
        n_nodes = batch.lengths if batch is not None else [0] * B
        T = 1 + (batch.width if batch is not None else 0)
        lens = torch.tensor([s.cache_len for s in seqs], dtype=torch.long)
        gen = torch.tensor([len(s.output_ids) for s in seqs], dtype=torch.long)
        last = torch.tensor([[s.last_token] for s in seqs], dtype=torch.long)
        if batch is None:
            ids = last
            depth = torch.zeros(B, 1, dtype=torch.long)
            tokens = ids.clone()
            parents = torch.full((B, 1), -1, dtype=torch.long)
        else:
            # The whole batch's trees as tensors: node i of a row is column i + 1 (column 0 is
            # the row's last token, the root); padding past a row's length scores nothing.
            valid = torch.arange(T - 1).unsqueeze(0) < torch.tensor(n_nodes).unsqueeze(1)
            tokens = torch.cat([last, torch.where(valid, batch.tokens, -1)], 1)
            parents = torch.cat([torch.full((B, 1), -1, dtype=torch.long), torch.where(valid, batch.parents + 1, -1)], 1)
            depth = torch.cat([torch.zeros(B, 1, dtype=torch.long), torch.where(valid, batch.depths, 0)], 1)
            ids = tokens.clamp(min=0)
        max_depth = int(depth.max())
        positions = (lens.unsqueeze(1) + depth).to(dev)
        write_pos = (lens.unsqueeze(1) + torch.arange(T)).to(dev)
        kv_len = int(lens.max()) + T
        chain = batch is None or batch.is_path
        parents_d = parents.to(dev)
        anc = ancestors(parents_d, max_depth, chain=chain)
        lens_d = lens.to(dev)
        view = self.cache.view(0, B, write_pos, self._tree_mask(lens_d, anc, kv_len))
        # A tree node reads its ancestors where the tree put them, in depth order (invariant
        # numerics need the same keys in the same logical places as the branch's path decode).
        key_pos = _logical_keys(lens_d, anc, depth.to(dev), max_depth, kv_len) \
            if self.invariant and not chain else None
        logits = self.forward(ids.to(dev), positions, view, key_pos=key_pos, return_hidden=self.keep_hidden)
        hidden = None
        if self.keep_hidden:
            logits, hidden = logits  # [B, T, V], [B, T, H]
        self.num_forwards += 1
        out_pos = gen.unsqueeze(1) + depth  # index of the output token drawn at each node
        batch = _sampling_batch(seqs, out_pos, dev)
        drawn, logps = sample(logits.reshape(B * T, -1), batch)
        drawn, logps = drawn.view(B, T), logps.view(B, T)
        if T == 1:
            emit_tok, emit_lp = drawn.tolist(), logps.tolist()
            for b, s in enumerate(seqs):
                s.cache_len += 1
                if hidden is not None:
                    s.hidden = hidden[b, 0]
            return DecodeResult(emit_tok, emit_lp, [0] * B, [0] * B)
        tokens_d = tokens.to(dev)
        path, n_acc = walk_tree(drawn, tokens_d, parents_d, depth.to(dev), anc, max_depth, chain=chain)
        self._keep_paths(lens_d, path, n_acc)
        # Emitted: the accepted drafts (tokens on the path after the root), then the token drawn
        # at the last accepted node; the log-prob of each is that drawn at its parent.
        last_node = path.gather(1, n_acc.unsqueeze(1))
        final = drawn.gather(1, last_node)
        if hidden is not None:  # the state that drew the final token, per row
            h_last = hidden.gather(1, last_node.unsqueeze(2).expand(-1, -1, hidden.shape[-1]))[:, 0]
            for b, s in enumerate(seqs):
                s.hidden = h_last[b]
        emit = torch.cat([tokens_d.gather(1, path[:, 1:]), final], 1).scatter_(1, n_acc.unsqueeze(1), final)
        emit_c, lp_c = emit.tolist(), logps.gather(1, path).tolist()
        n_acc_c = n_acc.tolist()
        out_tok, out_lp = [], []
        for b, s in enumerate(seqs):
            n = n_acc_c[b]
            out_tok.append(emit_c[b][: n + 1])
            out_lp.append(lp_c[b][: n + 1])
            s.cache_len += n + 1
        return DecodeResult(out_tok, out_lp, n_nodes, n_acc_c)

    def _tree_mask(self, lens: torch.Tensor, anc: torch.Tensor, kv_len: int) -> torch.Tensor:
        """``[B, 1, T, kv_len]``: the cached prefix plus each node's ancestors (and itself)."""
        B, T, _ = anc.shape
        dev = lens.device
        mask = torch.arange(kv_len, device=dev).view(1, 1, kv_len) < lens.view(B, 1, 1)
        mask = mask.expand(B, T, kv_len).clone()
        cols = (lens.unsqueeze(1) + torch.arange(T, device=dev)).unsqueeze(1).expand(B, T, T)
        mask.scatter_(2, cols, anc)
        return mask.unsqueeze(1)

    def _keep_paths(self, lens: torch.Tensor, path: torch.Tensor, n_acc: torch.Tensor) -> None:
        """Move each accepted path's K/V to consecutive positions after the prefix."""
        B, D = path.shape
        depth = torch.arange(D, device=path.device).expand(B, D)
        move = (depth <= n_acc.unsqueeze(1)) & (path != depth)
        if not bool(move.any()):
            return  # path drafts: node index == depth, nothing moves
        rows = torch.arange(B, device=path.device).unsqueeze(1).expand(B, D)[move]
        self.cache.gather_positions(rows, (lens.unsqueeze(1) + path)[move], (lens.unsqueeze(1) + depth)[move])
