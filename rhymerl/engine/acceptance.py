"""Lossless acceptance of drafted token trees.

At every tree node the engine draws the token ``y`` that plain decoding would have drawn
there (same distribution, same seeded uniform). Starting at the root, the walk moves to
the child whose token equals ``y``; when no child matches, ``y`` itself is emitted and the
walk stops. Every emitted token is therefore exactly what plain decoding emits, for any
tree shape; the drafter only decides which candidates get a chance.

The walk is computed without a loop over depth: a node is on the accepted path exactly
when it and each of its drafted ancestors carry the token drawn at their parent, and the
ancestor sets are the same ones the tree attention mask is built from.
"""
from __future__ import annotations

import torch


def ancestors(parents: torch.Tensor, max_depth: int, chain: bool = False) -> torch.Tensor:
    """``[B, T, T]`` bool: ``anc[b, i, j]`` when node ``j`` is ``i`` itself or an ancestor of it.

    ``parents`` is ``[B, T]`` with node 0 the root (parent -1) and -1 for padding nodes
    (which then hang under the root). ``chain=True`` promises every row is a path draft
    (node ``i``'s parent is ``i - 1``), whose ancestors are all earlier nodes: no search.
    Padding nodes of a chain row see earlier nodes too; their outputs are never used.
    """
    B, T = parents.shape
    dev = parents.device
    if chain:
        return torch.ones(T, T, dtype=torch.bool, device=dev).tril().expand(B, T, T)
    # Reachability by repeated squaring of (parent edge | self): ceil(log2(depth)) products.
    reach = torch.zeros(B, T, T, device=dev)
    reach.scatter_(2, parents.clamp(min=0).unsqueeze(2), 1.0)
    reach.diagonal(dim1=1, dim2=2).fill_(1.0)
    hops = 1
    while hops < max_depth:
        reach = torch.bmm(reach, reach).clamp_(max=1.0)
        hops *= 2
    return reach > 0


def walk_tree(sampled: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
              anc: torch.Tensor, max_depth: int, chain: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted path through each row's tree.

    Args:
        sampled: ``[B, T]`` the token drawn at each node (node 0 is the root, i.e. the
            sequence's last token; nodes ``1..`` are drafts; padding nodes are ignored).
        tokens: ``[B, T]`` each node's token (-1 for padding).
        parents: ``[B, T]`` each node's parent index (-1 for the root and for padding).
        depth: ``[B, T]`` each node's depth (0 for the root).
        anc: ``[B, T, T]`` from :func:`ancestors`.
        max_depth: the deepest draft node's depth.
        chain: every row is a path draft (node ``i`` follows node ``i - 1``), as for
            :func:`ancestors`: the walk is then the run of matches from the root.

    Returns:
        ``path [B, max_depth + 1]`` node indices from the root (entries past the accepted
        length repeat the last accepted node) and ``n_accepted [B]`` drafted tokens accepted.
        The tokens to emit are ``tokens[path[1..n]]`` followed by ``sampled[path[n]]``.
    """
    B, T = tokens.shape
    D = max_depth
    if chain:
        ok = (tokens[:, 1 : D + 1] == sampled[:, :D]).to(torch.long)
        n_acc = ok.cumprod(1).sum(1)
        steps = torch.arange(D + 1, device=tokens.device)
        return torch.minimum(steps.unsqueeze(0), n_acc.unsqueeze(1)), n_acc
    edge_ok = tokens == sampled.gather(1, parents.clamp(min=0))
    edge_ok[:, 0] = True  # the root is always "accepted"
    # Siblings carry distinct tokens, so at most one node per depth is on the path.
    on_path = ~(anc & ~edge_ok.unsqueeze(1)).any(-1)
    n_acc = on_path.sum(1) - 1
    slot = torch.where(on_path, depth, torch.full_like(depth, D + 1))
    nodes = torch.arange(T, device=tokens.device).expand(B, T)
    path = torch.zeros(B, D + 2, dtype=torch.long, device=tokens.device).scatter_(1, slot, nodes)[:, : D + 1]
    last = path.gather(1, n_acc.unsqueeze(1))
    path = torch.where(torch.arange(D + 1, device=tokens.device) <= n_acc.unsqueeze(1), path, last)
    return path, n_acc
