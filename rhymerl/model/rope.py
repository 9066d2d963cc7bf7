"""Rotary position embeddings, with the scaling types used by Llama and Qwen configs."""
from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` and the cos/sin attention factor.

    Supports ``default``, ``linear``, ``llama3`` and ``yarn``; other types raise, because a
    silently wrong RoPE gives a model that loads and then writes nonsense.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv.float(), 1.0
    assert scaling is not None
    factor = float(scaling.get("factor", 1.0))
    if rope_type == "linear":
        return (inv / factor).float(), 1.0
    if rope_type == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wl, high_wl = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(medium, smoothed, scaled).float(), 1.0
    if rope_type == "yarn":
        old_len = scaling["original_max_position_embeddings"]
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn = scaling.get("attention_factor")
        if attn is None:
            attn = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all \
                else get_mscale(factor)
        beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def corr_dim(rot: float) -> float:
            return head_dim * math.log(old_len / (rot * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        if lo == hi:
            hi += 0.001
        inv32 = inv.float()
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - lo) / (hi - lo)).clamp(0, 1)
        extrap = 1 - ramp
        return (inv32 / factor) * (1 - extrap) + inv32 * extrap, float(attn)
    raise NotImplementedError(f"rope type {rope_type!r} is not supported (default, linear, llama3, yarn)")


class RotaryEmbedding(torch.nn.Module):
    """Cos/sin tables looked up by explicit position ids, so tree drafts can share a position."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 max_position_embeddings: int) -> None:
        super().__init__()
        # A plain attribute, not a buffer: models are built on the meta device and then
        # loaded, and this table must be computed, not loaded.
        self.inv_freq, self.attention_factor = rope_inv_freq(head_dim, theta, scaling, max_position_embeddings)
        self._cache_len = 0
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def _build(self, n: int, device: torch.device, dtype: torch.dtype) -> None:
        n = max(n, 2 * self._cache_len, 256)
        t = torch.arange(n, device=device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.to(device))
        emb = torch.cat([freqs, freqs], dim=-1)
        self._cos = (emb.cos() * self.attention_factor).to(dtype)
        # rotate_half(x) * sin == roll(x, half) * sin_signed: the sign lives in the table.
        sin = emb.sin() * self.attention_factor
        half = sin.shape[-1] // 2
        self._sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(dtype)
        self._cache_len = n

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [B, T]`` -> cos, sin ``[B, 1, T, head_dim]``."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        if self._cos is None or need > self._cache_len or self._cos.device != positions.device \
                or self._cos.dtype != dtype:
            self._build(need, positions.device, dtype)
        assert self._cos is not None and self._sin is not None
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, T, D]`` (HF's rotate-half convention; ``sin_signed`` from
    :class:`RotaryEmbedding` carries rotate-half's sign)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed
