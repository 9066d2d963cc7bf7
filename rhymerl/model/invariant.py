"""A shape-invariant forward pass for the rollout engine.

The float result of a matmul depends on its shape: on this CPU (torch 2.13, MKL) one row of
``F.linear`` differs between a call with 1 row and one with 2, and between 2-5 rows and 16
or more, while for a *fixed* number of rows a row's result is bitwise the same wherever it
sits in the call and whatever the other rows hold. So the logits of a position drift with
the batch it ran in, and speculation (which scores more tokens per row) could pick another
token at a near-tie. Here every product is laid out so that a token's result does not depend
on how many tokens share the call, so the logits at a position are bitwise the same in a
prefill, a 1-token decode or a path or tree verification, at any batch size or slot:

- a matmul's *columns* are bitwise the same whatever the number of columns (2 or more) when
  its rows and reduction length are fixed (measured: every column count from 2 to 700, for
  the shapes below). So tokens go in the columns: a linear is computed as ``W @ x^T`` (rows =
  output features, fixed), for every weight shape that passes a self-test when the engine
  starts; a shape that fails it (on this CPU: fp32 with a reduction of 896 or more, where MKL
  blocks the reduction by the problem size), or is too large to self-test cheaply, falls back
  to tiles of exactly ``ROW_TILE`` rows; results return to token-major rows (a copy);
- attention per (row, KV head) reads keys padded to whole chunks of ``KEY_CHUNK`` positions:
  scores are ``K @ Q^T`` (a row per key, a column per query), the weighted values
  ``[V_chunk | 1]^T @ P^T`` per chunk (the column of ones gives the softmax denominator from
  the same fixed-shape product), summed chunk by chunk in position order; chunks past a row's
  length add exact zeros. A tree node reads its keys in *logical* order (the prompt's, then its
  ancestors' by depth), gathered where the tree put them, so it computes exactly what the path
  decode of its branch computes;
- norms and softmax are row-wise kernels, and transcendental elementwise work (SiLU, exp) runs
  on token-major rows or 64-key chunks, whole vector widths, so no token's entries fall into a
  vectorised loop's scalar tail (which may round differently).

The same code runs on CUDA (invariance there rests on the same fixed-shape argument, but is
not measured here). Training and HF-parity paths keep :class:`CausalLM`'s plain forward.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rhymerl.model.llama import Attention, CacheView, CausalLM
from rhymerl.model.rope import apply_rope

ROW_TILE = 64
KEY_CHUNK = 64
_SELF_TEST_COLUMNS = (2, 3, 5, 8, 13, 16, 31, 64, 65, 100, 128, 250, 256, 511, 1024, 2049, 4352)
_SELF_TEST_FLOPS = 4e9  # a weight too large to self-test within this uses the row tiles (always safe)
_transposed_ok: dict[tuple, bool] = {}


def _transposed_is_invariant(weight: torch.Tensor) -> bool:
    """Whether ``weight @ x^T`` gives each column the same bits at every column count here
    (checked once per shape, dtype, device and thread count against the widest product)."""
    key = (tuple(weight.shape), weight.dtype, weight.device.type, torch.get_num_threads())
    ok = _transposed_ok.get(key)
    if ok is None and 2 * weight.numel() * sum(_SELF_TEST_COLUMNS) > _SELF_TEST_FLOPS:
        ok = _transposed_ok[key] = False
    if ok is None:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(weight.shape, generator=g).to(weight)
        x = torch.randn(max(_SELF_TEST_COLUMNS), weight.shape[1], generator=g).to(weight)
        # Every column, not just the first ones: a column count's last columns may take another
        # kernel path (seen on an AMD EPYC: 3 columns of fp32, the third's bits differ).
        ref = torch.mm(w, x.t())
        ok = all(torch.equal(torch.mm(w, x[:r].t()), ref[:, :r]) for r in _SELF_TEST_COLUMNS)
        _transposed_ok[key] = ok
    return ok


_min_cols: dict[tuple, int] = {}


def _min_columns(D: int, device: torch.device, dtype: torch.dtype) -> int:
    """The fewest columns from which the attention's batched products (``[n, D] @ [D, R]`` and
    ``[D + 1, n] @ [n, R]``) give each column the same bits at every larger column count here
    (measured once per head size, device, dtype and thread count; at least 2)."""
    key = (D, device.type, dtype, torch.get_num_threads())
    got = _min_cols.get(key)
    if got is None:
        g = torch.Generator().manual_seed(0)
        top = 64
        k = torch.randn(4, KEY_CHUNK, D, generator=g).to(device, dtype)
        c = torch.randn(4, D, top, generator=g).to(device, dtype)
        v = torch.randn(4, D + 1, KEY_CHUNK, generator=g).to(device, dtype)
        p = torch.randn(4, KEY_CHUNK, top, generator=g).to(device, dtype)
        s_ref, o_ref = torch.bmm(k, c), torch.bmm(v, p)
        got = 2
        for r in range(top - 1, 1, -1):
            if not (torch.equal(torch.bmm(k, c[:, :, :r]), s_ref[:, :, :r])
                    and torch.equal(torch.bmm(v, p[:, :, :r]), o_ref[:, :, :r])):
                got = r + 1
                break
        _min_cols[key] = got
    return got


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose every row is independent of how many rows came with it."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    R = x2.shape[0]
    if _transposed_is_invariant(weight):
        if R == 1:  # one column is a matrix-vector product, computed differently
            x2 = torch.cat([x2, x2])
        # Token-major again (a copy): elementwise work after it (SiLU, residuals) must see whole
        # feature rows, or a token's last entries may land in a vector loop's scalar tail.
        out = torch.mm(weight, x2.t()).t()[:R].contiguous()
    else:
        Rp = -(-R // ROW_TILE) * ROW_TILE
        if Rp != R:
            x2 = torch.cat([x2, x2.new_zeros(Rp - R, x2.shape[1])])
        out = x2.new_empty(Rp, weight.shape[0])
        wt = weight.t()
        for i in range(0, Rp, ROW_TILE):
            torch.mm(x2[i:i + ROW_TILE], wt, out=out[i:i + ROW_TILE])
        out = out[:R]
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], weight.shape[0])


def chunked_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, positions: torch.Tensor, n: int,
                      key_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q [B, H, T, D]`` (queries at absolute ``positions [B, T]``) over the keys at
    logical positions ``0..position`` of a cache ``kc, vc [B, KV, cap, D]``, read in chunks of
    ``KEY_CHUNK`` up to ``n`` (a multiple of it).

    ``key_pos [B, T, n]`` maps each query's logical key position to the cache position that
    holds it (tree verification: a node's ancestors sit where the tree put them); None means
    logical = physical (prefill, decode, path verification). Returns ``[B, H, T, D]``.
    """
    # Kept flat on purpose (over 60 lines): the batch-invariant kernel, whose reduction order is its contract.
    B, H, T, D = q.shape
    KV = kc.shape[1]
    G = H // KV
    nC = n // KEY_CHUNK
    f32 = torch.float32
    scale = 1.0 / math.sqrt(D)
    per_node = key_pos is not None
    # Columns: the G query heads of one KV head at every position of a row (their keys are
    # the row's), or of one tree node (each node its own keys). A column's result does not
    # depend on the other columns, so both layouts give the same bits for the same query.
    q5 = q.to(f32).reshape(B, KV, G, T, D)
    if per_node:
        cols = q5.permute(0, 1, 3, 4, 2).reshape(B * KV * T, D, G)
        limit = positions.view(B, 1, T, 1).expand(B, KV, T, G).reshape(B * KV * T, 1, 1, G)
    else:
        cols = q5.permute(0, 1, 4, 2, 3).reshape(B * KV, D, G * T)
        limit = positions.view(B, 1, 1, T).expand(B, KV, G, T).reshape(B * KV, 1, 1, G * T)
    E, _, R = cols.shape
    # Too few columns take another kernel path (one is a matrix-vector product; on an AMD EPYC
    # fewer than 12 give other bits than 12 or more): pad with copies of the first column.
    pad = max(R, _min_columns(D, q.device, f32)) - R
    if pad:
        cols = torch.cat([cols, cols[:, :, :1].expand(E, D, pad)], 2)
        limit = torch.cat([limit, limit[..., :1].expand(*limit.shape[:-1], pad)], 3)
    Rc = cols.shape[2]

    # Values with a column of ones: [V | 1]^T @ P^T gives the weighted values and, in its last
    # row, the softmax denominator, from one fixed-shape product per chunk. The engine's cache
    # keeps the ones in place (``KVCache(value_ones=True)``); a plain cache gets them here.
    if vc.shape[-1] == D + 1:
        v1 = vc[:, :, :n].to(f32)
    else:
        v1 = torch.cat([vc[:, :, :n].to(f32), vc.new_ones(B, KV, n, 1, dtype=f32)], 3)
    kf = kc[:, :, :n].to(f32)

    def chunk(c: int, cache: torch.Tensor) -> torch.Tensor:
        """Chunk ``c`` of ``cache [B, KV, n, F]`` for every column group: ``[E, KEY_CHUNK, F]``."""
        lo = c * KEY_CHUNK
        F_ = cache.shape[-1]
        if per_node:
            idx = key_pos[:, :, lo:lo + KEY_CHUNK].reshape(B, 1, T * KEY_CHUNK, 1).expand(B, KV, T * KEY_CHUNK, F_)
            return cache.gather(2, idx).view(E, KEY_CHUNK, F_)
        return cache[:, :, lo:lo + KEY_CHUNK].reshape(E, KEY_CHUNK, F_)

    # Scores in one product (rows = keys: each row's result is the same at any key count that
    # is a whole number of chunks, measured for head sizes 32-128), the values chunk by chunk.
    if per_node:
        idx = key_pos.reshape(B, 1, T * n, 1).expand(B, KV, T * n, D)
        keys = kf.gather(2, idx).view(E, n, D)
    else:
        keys = kf.reshape(E, n, D)
    s = torch.bmm(keys, cols).view(E, nC, KEY_CHUNK, Rc).mul_(scale)
    kpos = torch.arange(n, device=q.device).view(1, nC, KEY_CHUNK, 1)
    s.masked_fill_(kpos > limit, float("-inf"))
    p = s.sub_(s.amax(dim=(1, 2), keepdim=True)).exp_()
    out = None
    for c in range(nC):  # chunks in position order
        part = torch.bmm(chunk(c, v1).transpose(1, 2), p[:, c])  # [E, D + 1, Rc]
        out = part if out is None else out + part
    assert out is not None
    res = (out[:, :D] / out[:, D:])[:, :, :R]  # [E, D, R]
    if per_node:
        res = res.view(B, KV, T, D, G).permute(0, 1, 4, 2, 3)
    else:
        res = res.view(B, KV, D, G, T).permute(0, 1, 3, 4, 2)
    return res.reshape(B, H, T, D).to(q.dtype)


def _attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: CacheView,
               positions: torch.Tensor, n: int, key_pos: torch.Tensor | None) -> torch.Tensor:
    B, T, _ = x.shape
    H, KV, D = attn.n_heads, attn.n_kv, attn.head_dim
    qkv = invariant_linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias).view(B, T, H + 2 * KV, D)
    qk, v = qkv[:, :, : H + KV], qkv[:, :, H + KV:]
    if attn.qk_norm:
        qk = torch.cat([attn.q_norm(qk[:, :, :H]), attn.k_norm(qk[:, :, H:])], dim=2)
    qk = apply_rope(qk.transpose(1, 2), cos, sin)
    q, k = qk[:, :H], qk[:, H:]
    v = v.transpose(1, 2)
    kc, vc = cache.k[attn.layer_idx], cache.v[attn.layer_idx]
    idx = cache.flat_index()
    kc.view(-1, D).index_copy_(0, idx, k.reshape(-1, D))
    Fv = vc.shape[-1]  # D, or D + 1 with the cache's column of ones
    v_rows = v.reshape(-1, D)
    if Fv == D + 1:
        v_rows = torch.cat([v_rows, v_rows.new_ones(v_rows.shape[0], 1)], 1)
    vc.view(-1, Fv).index_copy_(0, idx, v_rows)
    out = chunked_attention(q, kc, vc, positions, n, key_pos)
    return invariant_linear(out.transpose(1, 2).reshape(B, T, H * D), attn.o_proj.weight, attn.o_proj.bias)


def invariant_forward(model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor, cache: CacheView,
                      logits_index: torch.Tensor | None = None, key_pos: torch.Tensor | None = None,
                      return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:meth:`CausalLM.forward` against the engine's cache, with shape-invariant numerics.

    Each query attends to the keys at logical positions ``0..positions[b, t]`` (its own
    included); ``cache.attn_mask`` is not read. ``key_pos`` as in :func:`chunked_attention`.
    """
    dec = model.model
    cap = cache.k.shape[3]
    n = min(cap, -(-cache.kv_len // KEY_CHUNK) * KEY_CHUNK)
    if n % KEY_CHUNK:
        raise ValueError(f"invariant forward: cache capacity {cap} is not a multiple of {KEY_CHUNK}")
    x = dec.embed_tokens(input_ids)
    cos, sin = dec.rotary_emb(positions, x.dtype)
    for layer in dec.layers:
        x = x + _attention(layer.self_attn, layer.input_layernorm(x), cos, sin, cache, positions, n, key_pos)
        h = layer.post_attention_layernorm(x)
        mlp = layer.mlp
        gate, up = invariant_linear(h, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias).split(mlp.inter, dim=-1)
        x = x + invariant_linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
    h = dec.norm(x)
    if logits_index is not None:
        h = h.gather(1, logits_index.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
    logits = invariant_linear(h, model.lm_head.weight)
    return (logits, h) if return_hidden else logits
