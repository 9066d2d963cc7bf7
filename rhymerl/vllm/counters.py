"""vLLM's speculative counters, read from a ``vllm.LLM``: how many drafts and accepted tokens so
far. Needs the engine's statistics on (``disable_log_stats=False``; ``RHYMERL_HISTOSPEC`` turns
them on); zeros where they are off, as for an engine without speculation.

The counts are read from this LLM's own Prometheus logger, not from the process's registry: every
new ``vllm.LLM`` re-registers the ``vllm:`` metrics under the same names and labels, so the
registry describes whichever engine was built last, not necessarily the one asked about."""
from __future__ import annotations

from typing import Any


def _total(counters: dict) -> int:
    """One per-engine counter summed over the LLM's engines (each a labelled Prometheus child)."""
    return int(sum(s.value for child in counters.values() for m in child.collect()
                   for s in m.samples if s.name.endswith("_total")))


def spec_counters(llm: Any) -> tuple[int, int]:
    """(drafts, accepted draft tokens) so far, summed over the LLM's engines."""
    manager = getattr(llm.llm_engine, "logger_manager", None)
    if not llm.llm_engine.log_stats or manager is None:
        return 0, 0
    for logger in manager.stat_loggers:
        prom = getattr(logger, "spec_decoding_prom", None)
        if prom is not None:
            if not prom.spec_decoding_enabled:
                return 0, 0
            return _total(prom.counter_spec_decode_num_drafts), _total(prom.counter_spec_decode_num_accepted_tokens)
    raise RuntimeError("this vLLM's stat loggers hold no speculative counters (vllm.v1.metrics changed?): "
                       f"{[type(x).__name__ for x in manager.stat_loggers]}")
