"""Coupled drafting: a model source draws each proposal with the uniform the target's sampler
will use at that output position, and the tree its drafts make."""
from __future__ import annotations

import torch

from rhymerl.drafting.source import Candidate
from rhymerl.engine.draft import DraftTree
from rhymerl.engine.sampler import SamplingBatch, sample
from rhymerl.engine.sequence import Sequence


def sampling_rows(seqs: list[Sequence], dev: torch.device) -> SamplingBatch:
    """The sequences' sampling parameters and draw keys, one row each (positions set per draw)."""
    f = torch.tensor([(s.params.temperature, s.params.top_p) for s in seqs], dtype=torch.float32, device=dev)
    i = torch.tensor([(s.params.top_k, s.draw_key) for s in seqs], dtype=torch.long, device=dev)
    return SamplingBatch(temperature=f[:, 0], top_p=f[:, 1], top_k=i[:, 0], key=i[:, 1],
                         position=torch.zeros(len(seqs), dtype=torch.long, device=dev))


def draw(logits: torch.Tensor, params: SamplingBatch, position: torch.Tensor, coupled: bool = True):
    """Per row: the drafted token (coupled: the target's uniform at output ``position`` inverted
    through the drafter's distribution; else the drafter's argmax), its probability under the
    drafter, and the drafter's best other token with its probability."""
    logits = logits.float()
    top2 = logits.topk(2, dim=-1)  # the order of the log-softmax, without computing it
    if coupled:
        tok, logp = sample(logits, SamplingBatch(params.temperature, params.top_p, params.top_k, params.key, position))
        p = logp.exp()
    else:
        tok = top2.indices[:, 0]
    alt_first = top2.indices[:, 0] == tok
    alt = torch.where(alt_first, top2.indices[:, 1], top2.indices[:, 0])
    lse = logits.logsumexp(-1)
    if not coupled:
        p = (top2.values[:, 0] - lse).exp()
    pa = (torch.where(alt_first, top2.values[:, 1], top2.values[:, 0]) - lse).exp()
    return tok, p, alt, pa


def candidates(name: str, rows: list[int], caps: list[int], k: int, draws: list[tuple], trees: bool,
               batch_rows: list[int] | None = None) -> dict[int, Candidate]:
    """Per row ``i`` of ``rows``: the drafted path, or with ``trees`` the path plus each
    position's best other token as a leaf, with each node's probability under the drafter.
    ``draws`` holds :func:`draw`'s results per position; ``batch_rows[r]`` is the batch row of
    ``rows[r]`` in them (default: the same index)."""
    toks, probs, alts, alt_probs = zip(*draws)
    tok_c = torch.stack(toks, 1).tolist()
    cum = torch.stack(probs, 1).double().cumprod(1)
    cum_c = cum.tolist()
    if trees:
        alt_c = torch.stack(alts, 1).tolist()
        before = torch.cat([torch.ones_like(cum[:, :1]), cum[:, :-1]], 1)
        alt_pc = (before * torch.stack(alt_probs, 1).double()).tolist()
    out = {}
    for r, i in enumerate(rows):
        b = batch_rows[r] if batch_rows is not None else r
        n = min(k, caps[i])
        if trees:
            tokens, parents, pr = [], [], []
            for j in range(n):
                parent = -1 if j == 0 else 2 * (j - 1)
                tokens += [tok_c[b][j], alt_c[b][j]]
                parents += [parent, parent]
                pr += [cum_c[b][j], alt_pc[b][j]]
            tree = DraftTree(tuple(tokens), tuple(parents))
        else:
            tree, pr = DraftTree.path(tok_c[b][:n]), cum_c[b][:n]
        out[i] = Candidate(name, tree=tree, probs=pr)
    return out
