"""Step-time cost curves: seconds of one decode step at batch size B, and of prefill per token.

The scheduler plans with them and the simulator replays with them.
:func:`rhymerl.distribution.factory.profile_engine` measures the curve of a real engine on
this machine; ``GPU_8B_H100`` is a documented model
of a GPU worker (see its comment) for simulating clusters we do not have.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class StepCost:
    """Decode step time interpolated (linearly, extrapolated past the ends) from measured points.

    Args:
        batch: batch sizes, increasing.
        seconds: decode step time at each batch size.
        prefill_per_token_s: prefill (and KV recompute after a migration) cost per token.
        name: where the numbers come from.
    """

    batch: tuple[int, ...]
    seconds: tuple[float, ...]
    prefill_per_token_s: float = 0.0
    name: str = "custom"
    _fit: tuple[float, float] = field(default=(0.0, 0.0), compare=False, repr=False)
    # step_s of integer batch sizes, as computed: the simulator asks for the same few per event
    _memo: dict[int, float] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.batch) != len(self.seconds) or not self.batch:
            raise ValueError("StepCost: batch and seconds must be non-empty and of equal length")
        if list(self.batch) != sorted(self.batch):
            raise ValueError("StepCost: batch sizes must increase")
        b = np.asarray(self.batch, dtype=np.float64)
        s = np.asarray(self.seconds, dtype=np.float64)
        slope, base = np.polyfit(b, s, 1) if len(b) > 1 else (0.0, float(s[0]))
        object.__setattr__(self, "_fit", (max(float(base), 1e-9), max(float(slope), 0.0)))

    @property
    def base_s(self) -> float:
        """Fixed part of a step (least-squares line through the points)."""
        return self._fit[0]

    @property
    def per_seq_s(self) -> float:
        """Added cost of one more sequence in the batch."""
        return self._fit[1]

    def step_s(self, B: int) -> float:
        """Seconds of one decode step with ``B`` running sequences (0 for an empty batch)."""
        s = self._memo.get(B)  # a float equal to a memoised int gets the same value
        if s is None:
            s = self._step_s(B)
            if type(B) is int:
                self._memo[B] = s
        return s

    def _step_s(self, B: float) -> float:
        if B <= 0:
            return 0.0
        bs, ss = self.batch, self.seconds
        if len(bs) == 1:
            return ss[0]
        if B <= bs[0]:
            i = 0
        elif B >= bs[-1]:
            i = len(bs) - 2
        else:
            i = int(np.searchsorted(bs, B)) - 1
        b0, b1, s0, s1 = bs[i], bs[i + 1], ss[i], ss[i + 1]
        return max(1e-9, s0 + (s1 - s0) * (B - b0) / (b1 - b0))

    def scaled(self, factor: float, name: str | None = None) -> "StepCost":
        """The same curve, ``factor`` times slower (e.g. workers sharing cores)."""
        return StepCost(self.batch, tuple(s * factor for s in self.seconds), self.prefill_per_token_s * factor,
                        name or f"{self.name} x{factor:g}")

    def to_dict(self) -> dict:
        return {"name": self.name, "batch": list(self.batch), "seconds": list(self.seconds),
                "prefill_per_token_s": self.prefill_per_token_s}

    @classmethod
    def from_dict(cls, d: dict) -> "StepCost":
        return cls(tuple(d["batch"]), tuple(d["seconds"]), d.get("prefill_per_token_s", 0.0), d.get("name", "custom"))


# A GPU-shaped worker: an 8B dense model (GQA, 8 KV heads of 128, 32 layers, bf16) on one
# H100-class GPU. A decode step reads the 16 GB of weights once (~5.5 ms at ~2.9 TB/s
# achieved) plus each sequence's KV cache (131 kB/token; 0.5 GB at an average context of
# 4K tokens, ~0.18 ms per sequence); compute (16 GFLOP/token) stays under the memory time
# up to a few hundred sequences. Prefill: 16 GFLOP/token at ~400 TFLOP/s achieved.
GPU_8B_H100 = StepCost(
    batch=(1, 64, 128, 256),
    seconds=(0.0057, 0.0057 + 64 * 0.00018, 0.0057 + 128 * 0.00018, 0.0057 + 256 * 0.00018),
    prefill_per_token_s=4e-5,
    name="gpu-8b-h100 (modelled)",
)
