"""Rollout engines by name (``rollout.engine``): the worker class that drives each, named by
its import path so that nothing here imports an engine (vLLM is an optional extra)."""
from __future__ import annotations

import importlib

ENGINES: dict[str, str] = {
    "native": "rhymerl.distribution.worker.RolloutWorker",  # this project's engine (bit-exact path)
    "vllm": "rhymerl.distribution.vllm_worker.VllmRolloutWorker",  # vLLM, with HistoSpec as its proposer
}


def get_worker_class(name: str) -> type:
    if name not in ENGINES:
        raise ValueError(f"rollout.engine {name!r} is not one of {sorted(ENGINES)}")
    module, cls = ENGINES[name].rsplit(".", 1)
    return getattr(importlib.import_module(module), cls)
