"""Rollout workers and the coordinator that drives them (in-process, local processes, or Ray)."""
from rhymerl.distribution.backends import InprocPool, ProcessPool, RayPool, WorkerPool, make_pool
from rhymerl.distribution.coordinator import PipeStats, RolloutCoordinator, RolloutRequest
from rhymerl.distribution.work import WorkerLost, WorkerSpec, WorkItem

__all__ = ["InprocPool", "PipeStats", "ProcessPool", "RayPool", "RolloutCoordinator", "RolloutRequest",
           "WorkItem", "WorkerLost", "WorkerPool", "WorkerSpec", "make_pool"]
