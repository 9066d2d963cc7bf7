"""rhymerl: on-policy RL for LLMs with history-accelerated rollouts (HistoSpec, HistoPipe)."""
from rhymerl.engine import LLM, RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
