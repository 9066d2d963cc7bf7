"""Lossless acceptance of drafted token trees.

At every tree node the engine draws the token ``y`` that plain decoding would have drawn
there (same distribution, same seeded uniform). Starting at the root, the walk moves to
the child whose token equals ``y``; when no child matches, ``y`` itself is emitted and the
walk stops. Every emitted token is therefore exactly what plain decoding emits, for any
tree shape; the drafter only decides which candidates get a chance.
"""
from __future__ import annotations

import torch


def walk_tree(sampled: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
              max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted path through each row's tree.

    Args:
        sampled: ``[B, T]`` the token drawn at each node (node 0 is the root, i.e. the
            sequence's last token; nodes ``1..`` are drafts; padding nodes are ignored).
        tokens: ``[B, T]`` each node's token (-1 for padding).
        parents: ``[B, T]`` each node's parent index (-1 for the root and for padding).
        max_depth: the deepest draft node's depth.

    Returns:
        ``path [B, max_depth + 1]`` node indices from the root (entries past the accepted
        length repeat the last accepted node) and ``n_accepted [B]`` drafted tokens accepted.
        The tokens to emit are ``tokens[path[1..n]]`` followed by ``sampled[path[n]]``.
    """
    B, T = tokens.shape
    nodes = torch.arange(T, device=tokens.device)
    # match[b, i, c]: node c is a child of node i carrying the token drawn at i.
    match = (parents.unsqueeze(1) == nodes.view(1, T, 1)) & (tokens.unsqueeze(1) == sampled.unsqueeze(2))
    has = match.any(-1)
    nxt = torch.where(has, match.to(torch.int8).argmax(-1), torch.full_like(nodes, -1).expand(B, T))
    cur = torch.zeros(B, dtype=torch.long, device=tokens.device)
    alive = torch.ones(B, dtype=torch.bool, device=tokens.device)
    path = [cur]
    for _ in range(max_depth):
        step = nxt.gather(1, cur.unsqueeze(1)).squeeze(1)
        alive = alive & (step >= 0)
        cur = torch.where(alive, step, cur)
        path.append(cur)
    paths = torch.stack(path, 1)
    n_acc = (paths[:, 1:] != paths[:, :-1]).sum(1)
    return paths, n_acc
