"""The rollout engine: continuous batching, KV cache, seeded sampling, tree verification
(the user-facing ``LLM`` is :mod:`rhymerl.llm`, above the engine and the drafters)."""
from rhymerl.engine.draft import DraftTree, Proposer
from rhymerl.engine.outputs import CompletionOutput, RequestOutput
from rhymerl.engine.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "DraftTree", "Proposer", "RequestOutput", "SamplingParams"]
