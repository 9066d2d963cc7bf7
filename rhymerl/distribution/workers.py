"""The rollout worker class that drives each engine of :data:`rhymerl.rollout_engines.ENGINES`,
by name (importing a worker module does not import its engine: vLLM loads when a worker starts)."""
from __future__ import annotations

from rhymerl.distribution.vllm_worker import VllmRolloutWorker
from rhymerl.distribution.worker import RolloutWorker
from rhymerl.rollout_engines import get_engine

WORKERS: dict[str, type] = {"native": RolloutWorker, "vllm": VllmRolloutWorker}


def get_worker_class(engine: str) -> type:
    return WORKERS[get_engine(engine).name]
