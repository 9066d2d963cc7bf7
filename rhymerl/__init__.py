"""rhymerl: on-policy RL for LLMs with history-accelerated rollouts (HistoSpec, HistoPipe)."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rhymerl.engine import RequestOutput, SamplingParams
    from rhymerl.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


_HOME = {"LLM": "rhymerl.llm", "RequestOutput": "rhymerl.engine", "SamplingParams": "rhymerl.engine"}


def __getattr__(name: str) -> Any:
    # Lazy, so that light processes (the reward pool's) import a submodule without torch.
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'rhymerl' has no attribute {name!r}")
