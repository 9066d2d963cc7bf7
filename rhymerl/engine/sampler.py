"""Seeded sampling whose random draw depends only on (seed, sample index, position).

Each draw is one uniform number from a counter-based hash (splitmix64) of those three
integers, turned into a token by inverting the CDF of the sampling distribution. No
shared random stream exists, so a request samples the same tokens alone, in any batch,
and with or without speculative decoding: the verifier uses the very same draw to decide
whether a drafted token is accepted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64 multipliers as signed int64
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _lsr(x, 30)
    x = x * _M1  # int64 multiplication wraps modulo 2**64, as the hash needs
    x = x ^ _lsr(x, 27)
    x = x * _M2
    return x ^ _lsr(x, 31)


def uniforms(seed: torch.Tensor, sample: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Float64 uniforms in [0, 1), one per element of the broadcast int64 inputs."""
    return uniforms_at(_mix(_mix(seed + _GOLDEN) ^ (sample * _GOLDEN + 1)), position)


def uniforms_at(key: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """:func:`uniforms` from a sequence's :func:`draw_key` (the hash of its seed and sample
    index, fixed for its life): one mixing round per draw instead of three."""
    h = _mix(key ^ (position * _M1 + 2))
    return _lsr(h, 11).to(torch.float64) * (1.0 / (1 << 53))


_U64 = (1 << 64) - 1


def _mix_int(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _U64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def draw_key(seed: int, sample: int) -> int:
    """The first two mixing rounds of :func:`uniforms`, in Python integers, as a signed int64:
    computed once per sequence, then :func:`uniforms_at` per position (same bits)."""
    h = _mix_int((seed + 0x9E3779B97F4A7C15) & _U64)
    h = _mix_int(h ^ ((sample * 0x9E3779B97F4A7C15 + 1) & _U64))
    return h - (1 << 64) if h >> 63 else h


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors (one row per scored position)."""

    temperature: torch.Tensor  # [N] float; 0 = greedy
    top_p: torch.Tensor  # [N] float
    top_k: torch.Tensor  # [N] int; -1 = off
    key: torch.Tensor  # [N] int64: draw_key(seed, sample index) of the row's sequence
    position: torch.Tensor  # [N] int64: index of the output token being drawn


def scaled_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``logits [N, V]`` over each row's temperature, in float32 (greedy rows: unscaled)."""
    if logits.dtype != torch.float32:
        logits = logits.float()
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(logits.dtype)
    return logits / t.unsqueeze(1)


CANDIDATES = 64  # top values per row first searched for the cut; rows whose cut lies beyond get a full sort


def removed_tokens(scaled: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor | None:
    """``[N, V]`` True where top-k or top-p removes a token of ``scaled`` (None: neither applies).

    Rules by value, so tied tokens share a fate and no sort order matters: top-k keeps tokens
    at least the k-th largest value; top-p then keeps a token while the probability mass (over
    what top-k kept) of tokens strictly more likely is below p. The most likely token always
    stays. The cut is searched among each row's top values first and only the rows whose cut
    lies beyond are sorted in full (a sort of [rows, 49k] was a quarter of a decode step at
    top-p 0.9). A row's result is the same bits either way (prefix sums are sequential).
    """
    k_on, p_on = top_k > 0, top_p < 1
    if not bool(k_on.any() or p_on.any()):
        return None
    V = scaled.shape[-1]
    k = torch.where(k_on, top_k, torch.full_like(top_k, V)).clamp(max=V)
    width = min(V, max(CANDIDATES, int(k.max()) if bool(k_on.any()) else 0))
    floor, resolved = _keep_floor(scaled, top_p, p_on, k, width)
    if width < V and not bool(resolved.all()):
        rows = (~resolved).nonzero().squeeze(1)
        floor[rows] = _keep_floor(scaled[rows], top_p[rows], p_on[rows], k[rows], V)[0]
    return scaled < floor.unsqueeze(1)


def _keep_floor(scaled: torch.Tensor, top_p: torch.Tensor, p_on: torch.Tensor, k: torch.Tensor,
                width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the least value kept (tokens below it are removed), from the row's top
    ``width`` values, and whether the cut lies among them (else the row needs a wider search)."""
    V = scaled.shape[-1]
    vals = scaled.topk(width, dim=-1).values if width < V else scaled.sort(dim=-1, descending=True).values
    kth = vals.gather(1, (k.clamp(max=width) - 1).unsqueeze(1)).squeeze(1)
    k_floor = torch.where(k < V, kth, torch.full_like(kth, float("-inf"))).unsqueeze(1)
    kept_by_k = vals >= k_floor
    # Mass over what top-k kept: normalised over the whole row, ties beyond the top values included.
    lse = torch.where(scaled >= k_floor, scaled, float("-inf")).logsumexp(-1, keepdim=True)
    probs = (vals - lse).exp().masked_fill(~kept_by_k, 0.0)
    before = probs.cumsum(-1) - probs  # mass of the tokens before each; the floor keeps ties whole
    kept = kept_by_k & ~(p_on.unsqueeze(1) & (before >= top_p.to(before.dtype).unsqueeze(1)))
    kept[:, 0] = True
    floor = torch.where(kept, vals, torch.full_like(vals, float("inf"))).amin(-1)
    # Resolved: the last candidate is removed, or no top-p and top-k's cut lies within.
    resolved = ~kept[:, -1] | ((k <= width) & ~p_on)
    return torch.where(p_on | (k < V), floor, torch.full_like(floor, float("-inf"))), resolved


def sampling_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                      top_k: torch.Tensor) -> torch.Tensor:
    """Log-probabilities ``[N, V]`` of the sampling distribution (-inf outside top-k/top-p).

    Greedy rows (temperature 0) get the model's plain log-softmax.
    """
    scaled = scaled_logits(logits, temperature)
    remove = removed_tokens(scaled, top_p, top_k)
    if remove is not None:
        scaled = scaled.masked_fill(remove, float("-inf"))
    return scaled.log_softmax(-1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits [N, V]``; returns ``(tokens [N], logprobs [N])``."""
    logp = sampling_logprobs(logits, batch.temperature, batch.top_p, batch.top_k)
    u = uniforms_at(batch.key, batch.position)
    # float64 CDF: the comparison with u must not depend on how the sum was blocked. Rows are
    # padded to whole vector widths (exp(-inf) = 0 adds nothing) so that no row's last entries
    # fall into the scalar tail of the vectorised exp, which may round differently: a row's
    # CDF is then the same bits at any batch size.
    V = logp.shape[-1]
    lp64 = logp.to(torch.float64)
    if V % 32:
        lp64 = torch.cat([lp64, lp64.new_full((lp64.shape[0], 32 - V % 32), float("-inf"))], 1)
    cdf = lp64.exp_().cumsum_(-1)
    if cdf.shape[-1] != V:
        cdf = cdf[:, :V].contiguous()
    # First index whose CDF exceeds u * total: a zero-probability token is never chosen.
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    tokens = tokens.clamp_(max=logits.shape[-1] - 1)
    greedy = batch.temperature == 0
    if bool(greedy.any()):
        tokens = torch.where(greedy, logits.argmax(-1), tokens)
    return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
