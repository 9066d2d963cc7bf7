"""vLLM's speculative counters, read from a ``vllm.LLM``: how many drafts and accepted tokens so
far. Needs the engine's statistics on (``disable_log_stats=False``; ``RHYMERL_HISTOSPEC`` turns
them on); zeros where they are off, as for an engine without speculation."""
from __future__ import annotations

from typing import Any


def spec_counters(llm: Any) -> tuple[int, int]:
    """(drafts, accepted draft tokens) so far, summed over the LLM's engines."""
    if not llm.llm_engine.log_stats:
        return 0, 0
    got = {m.name: int(getattr(m, "value", 0) or 0) for m in llm.get_metrics()}
    return got.get("vllm:spec_decode_num_drafts", 0), got.get("vllm:spec_decode_num_accepted_tokens", 0)
