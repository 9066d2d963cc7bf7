"""Draft source: a small causal LM with the target's tokenizer, drafting ``model_draft_tokens`` tokens
per row in as many batched forwards against a KV cache of its own.

**Coupled drafting.** The engine's sampler draws output token ``p`` of a sequence from one
uniform ``u(seed, sample, p)`` by inverting the distribution's CDF (:mod:`rhymerl.engine.sampler`).
The draft model draws its proposal for position ``p`` with that same ``u`` from its own
distribution (same temperature, top-k, top-p): wherever the two distributions are close, the
inverted CDFs pick the same token, so the target accepts far more often at T > 0 than it
accepts a greedy draft. Verification is unchanged, so tokens are exactly plain decoding's.

**Cache.** Each running sequence keeps the K/V of the tokens the draft model has seen, in a
slot that follows the engine's slot order (rows are moved when the engine's order changes).
Each propose first feeds every row what it has not seen (the tokens verification accepted,
or a new sequence's whole prompt, in one ragged forward), then drafts. Drafted tokens that
verification accepts keep their K/V; the rest are overwritten later (the rollback is a length).
With ``tree_budget > 0`` each drafted position also offers the draft's best other token as a
leaf, so a near-tie between two tokens costs one rejection less.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from rhymerl.drafting.coupled import candidates, draw, sampling_rows
from rhymerl.drafting.source import Candidate, DraftSource, SourceContext, register_source
from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.sequence import Sequence
from rhymerl.model import CacheView, CausalLM


@dataclass
class _Row:
    slot: int
    cached: int = 0  # tokens of all_ids() whose K/V are in the slot
    fed: list[int] = field(default_factory=list)  # drafted tokens whose K/V were written after `cached`
    start: int = 0  # the token of all_ids() at cache position 0 (the row's context restarted there)


def load_draft_model(path: str | Path, target: CausalLM) -> CausalLM:
    """Load a draft model for ``target``; refused, naming the mismatch, when it does not
    share the target's vocabulary and tokenizer."""
    from rhymerl.model import load_pretrained

    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"speculative.draft_model={path}: not a folder (an HF model folder is expected)")
    dev = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    try:
        draft = load_pretrained(p, device=dev, dtype=dtype).eval()
    except Exception as e:  # noqa: BLE001 - re-raised with the key that named the folder
        raise ValueError(f"speculative.draft_model={path}: cannot be loaded ({type(e).__name__}: {e})") from e
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise ValueError(f"speculative.draft_model={path}: vocabulary of {dv} tokens, the target's has {tv}; "
                         "a draft model must share the target's tokenizer")
    return draft


def check_same_tokenizer(draft_path: str | Path, target_path: str | Path) -> None:
    """Both folders' tokenizers must encode alike (compared by fingerprint when both have one)."""
    from rhymerl.tokenizer import load_tokenizer, tokenizer_fingerprint

    files = ("tokenizer.json", "tokenizer_config.json")
    if not any((Path(draft_path) / f).exists() for f in files) or \
            not any((Path(target_path) / f).exists() for f in files):
        return
    a = tokenizer_fingerprint(load_tokenizer(draft_path))
    b = tokenizer_fingerprint(load_tokenizer(target_path))
    if a != b:
        raise ValueError(f"speculative.draft_model={draft_path}: its tokenizer differs from the target's "
                         f"({target_path}); a draft model must share the target's tokenizer")


@register_source("draft_model")
class DraftModelSource(DraftSource):
    runs_a_model = True
    CATCH_UP = 32  # the most tokens a row feeds to catch up; a longer gap restarts its context

    def __init__(self, ctx: SourceContext, model: CausalLM | None = None) -> None:
        cfg = ctx.cfg
        if model is None:
            if not cfg.draft_model:
                raise ValueError("speculative: the draft_model source needs speculative.draft_model=PATH")
            if ctx.target is None:
                raise ValueError("speculative.draft_model: needs the target model (build it through LLM)")
            model = load_draft_model(cfg.draft_model, ctx.target)
            if ctx.target_path is not None:
                check_same_tokenizer(cfg.draft_model, ctx.target_path)
        self.model = model
        self.k = cfg.model_draft_tokens  # >= 1: SpecConfig.from_mapping and the run config check it
        self.coupled = cfg.coupled
        self.trees = cfg.tree_budget > 0
        self.max_nodes = 2 * self.k if self.trees else self.k
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache: KVCache | None = None
        self.rows: dict[tuple[int, int], _Row] = {}
        self.capacity = 0

    # --- the cache follows the engine's rows ------------------------------------------------
    def _ensure(self, B: int, need: int) -> None:
        c = self.cache
        if c is not None and c.num_slots >= B and c.capacity >= need:
            return
        slots = max(B, c.num_slots if c is not None else 0)
        slots = 1 << (slots - 1).bit_length()
        cap = max(need, c.capacity if c is not None else 0, 64)
        cap = -(-cap // 64) * 64
        new = KVCache(self.model.config, slots, cap, self.device, self.dtype)
        if c is not None:
            new.k[:, :c.num_slots, :, :c.capacity] = c.k
            new.v[:, :c.num_slots, :, :c.capacity] = c.v
        self.cache = new

    def _arrange(self, seqs: list[Sequence]) -> list[_Row]:
        """Put row ``i``'s K/V in slot ``i``; forget sequences no longer running."""
        keys = [(s.request_id, s.sample_index) for s in seqs]
        rows, moves_dst, moves_src = [], [], []
        for i, k in enumerate(keys):
            r = self.rows.get(k)
            if r is None:
                r = _Row(slot=i)
            elif r.slot != i:
                moves_dst.append(i)
                moves_src.append(r.slot)
                r.slot = i
            rows.append(r)
        if moves_dst:
            assert self.cache is not None
            dst = torch.tensor(moves_dst, device=self.device)
            src = torch.tensor(moves_src, device=self.device)
            self.cache.k[:, dst] = self.cache.k[:, src]  # the right side is gathered first
            self.cache.v[:, dst] = self.cache.v[:, src]
        self.rows = dict(zip(keys, rows))
        return rows

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], caps: list[int], rows: list[int]) -> dict[int, Candidate]:
        if not rows:
            return {}
        B = len(seqs)
        all_ids = [s.all_ids() for s in seqs]
        k = min(self.k, max(caps[i] for i in rows))
        self._ensure(B, 0)  # slots for every row before rows move into them
        state = self._arrange(seqs)
        self._reconcile(state, all_ids, seqs)
        new = [ids[r.cached:] for r, ids in zip(state, all_ids)]
        T = max(len(x) for x in new)
        longest = max(len(x) - r.start for r, x in zip(state, all_ids))
        self._ensure(B, longest + T + k + 2)
        cache = self.cache
        assert cache is not None
        dev = self.device
        base = torch.tensor([r.cached - r.start for r in state], device=dev)  # cache positions
        lens = torch.tensor([len(x) for x in new], device=dev)
        ids = torch.zeros(B, T, dtype=torch.long)
        for b, x in enumerate(new):
            ids[b, : len(x)] = torch.tensor(x)
        ids = ids.to(dev)
        t = torch.arange(T, device=dev)
        pos = base.unsqueeze(1) + t  # padding positions write past the row's tokens, read by nobody
        kv_len = int(pos.max()) + 1
        mask = torch.arange(kv_len, device=dev).view(1, 1, kv_len) <= pos.unsqueeze(2)
        view = CacheView(cache.k[:, :B], cache.v[:, :B], pos, mask.unsqueeze(1))
        logits = self.model(ids, pos, view, logits_index=(lens - 1).unsqueeze(1))[:, 0]
        end = base + lens  # the next cache position of each row
        out_pos = torch.tensor([len(s.output_ids) for s in seqs], device=dev)
        params = sampling_rows(seqs, dev)
        draws = []
        for j in range(k):
            draws.append(draw(logits, params, out_pos + j, self.coupled))
            if j == k - 1:
                break
            tok = draws[-1][0]
            pos = (end + j).unsqueeze(1)
            kv_len = int(pos.max()) + 1
            mask = torch.arange(kv_len, device=dev).view(1, 1, kv_len) <= pos.unsqueeze(2)
            view = CacheView(cache.k[:, :B], cache.v[:, :B], pos, mask.unsqueeze(1))
            logits = self.model(tok.unsqueeze(1), pos, view)[:, 0]
        fed = torch.stack([d[0] for d in draws[: k - 1]], 1).tolist() if k > 1 else [[] for _ in range(B)]
        end_c = end.tolist()
        for b, r in enumerate(state):
            r.cached, r.fed = end_c[b] + r.start, fed[b]
        return candidates(self.name, rows, caps, k, draws, self.trees, batch_rows=rows)

    def _reconcile(self, state: list, all_ids: list[list[int]], seqs: list[Sequence]) -> None:
        """What verification kept of last step's drafts keeps its K/V; each row's next feed starts
        after it (the last token is always fed: its logits draft)."""
        for r, ids, seq in zip(state, all_ids, seqs):
            if r.fed:
                n = 0
                tail = ids[r.cached:]
                while n < len(r.fed) and n < len(tail) and tail[n] == r.fed[n]:
                    n += 1
                r.cached += n
                r.fed = []
            r.cached = min(r.cached, len(ids) - 1)
            if len(ids) - max(r.cached, len(seq.prompt_ids)) > self.CATCH_UP:
                # More than CATCH_UP tokens generated since this model last saw the row (the gate
                # held drafting off): restart the row's context on its last tokens, at positions
                # from 0, rather than feed all it missed (at batch 128 that catch-up cost more
                # than the target's step). Drafts only: verification keeps the tokens exact.
                r.start = r.cached = len(ids) - self.CATCH_UP

    def on_finish(self, seq: Sequence) -> None:
        self.rows.pop((seq.request_id, seq.sample_index), None)
