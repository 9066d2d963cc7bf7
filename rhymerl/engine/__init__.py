"""The rollout engine: continuous batching, KV cache, seeded sampling, tree verification."""
from rhymerl.engine.draft import DraftTree, Proposer
from rhymerl.engine.llm import LLM
from rhymerl.engine.outputs import CompletionOutput, RequestOutput
from rhymerl.engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "DraftTree", "Proposer", "RequestOutput", "SamplingParams"]
