"""Preallocated KV memory: one fixed-capacity slot per running sequence.

Running sequences always occupy slots ``0..B-1`` (a finished sequence's slot is refilled by
moving the last one into it), so every forward pass reads the cache through plain views
``k[:, :B]`` with no gather. Memory is allocated once, up front, and bounded by the
configured token budget: a request that finds no free slot waits; none is ever lost.
"""
from __future__ import annotations

import torch

from rhymerl.model import CacheView, ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, capacity: int, device: torch.device,
                 dtype: torch.dtype, *, value_ones: bool = False) -> None:
        """``value_ones``: each cached value carries a trailing 1 (``head_dim + 1`` features), which
        the invariant forward's ``[V | 1]`` products read in place instead of building per step."""
        assert cfg.head_dim is not None
        shape = (cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(*shape[:-1], cfg.head_dim + int(value_ones), device=device, dtype=dtype)
        if value_ones:
            self.v[..., -1] = 1.0
        self.num_slots, self.capacity = num_slots, capacity

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        assert cfg.head_dim is not None
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize

    def view(self, start: int, end: int, write_pos: torch.Tensor, attn_mask: torch.Tensor) -> CacheView:
        return CacheView(self.k[:, start:end], self.v[:, start:end], write_pos, attn_mask)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` cached tokens of slot ``src`` into slot ``dst``."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def fan_out(self, src: int, dst_start: int, count: int, length: int) -> None:
        """Copy slot ``src``'s prefix into ``count`` consecutive slots (a prompt's n samples)."""
        self.k[:, dst_start:dst_start + count, :, :length] = self.k[:, src:src + 1, :, :length]
        self.v[:, dst_start:dst_start + count, :, :length] = self.v[:, src:src + 1, :, :length]

    def gather_positions(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Within each slot, move the K/V at position ``src`` to ``dst`` (accepted tree paths)."""
        if slots.numel() == 0:
            return
        self.k[:, slots, :, dst] = self.k[:, slots, :, src]
        self.v[:, slots, :, dst] = self.v[:, slots, :, src]
