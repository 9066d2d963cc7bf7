"""rhymerl: on-policy RL for LLMs with history-accelerated rollouts (HistoSpec, HistoPipe)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rhymerl.engine import RequestOutput, SamplingParams
    from rhymerl.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy, so that light processes (the reward pool's) import a submodule without torch.
    if name == "LLM":
        from rhymerl.llm import LLM

        return LLM
    if name in __all__:
        from rhymerl import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'rhymerl' has no attribute {name!r}")
