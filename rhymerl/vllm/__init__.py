"""vLLM as a rollout engine: HistoSpec as a vLLM proposer, the CPU sampler correction, and the
engine adapter rhymerl's rollout workers drive. Importing this package does not import vLLM."""
from __future__ import annotations

from typing import Any

__all__ = ["HistoSpecProposer"]


def __getattr__(name: str) -> Any:
    # vLLM loads ``rhymerl.vllm.HistoSpecProposer`` by name (speculative method custom_class).
    if name == "HistoSpecProposer":
        from rhymerl.vllm.proposer import HistoSpecProposer

        return HistoSpecProposer
    raise AttributeError(name)
