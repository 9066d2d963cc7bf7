"""HistoPipe: response lengths predicted from history, and the plans that place a rollout
step's work on workers (placement, allocation) plus the rules that move it (tail migration).
Everything here is a plain function of lengths and a cost curve, so the simulator and the
real coordinator use the same code."""
from rhymerl.scheduling.cost import GPU_8B_H100, StepCost
from rhymerl.scheduling.length_predictor import predict_lengths, spearman
from rhymerl.scheduling.plan import Plan, WorkUnit
from rhymerl.scheduling.planner import ORACLES, POLICIES, make_plan
from rhymerl.scheduling.simulator import SimResult, simulate

__all__ = ["GPU_8B_H100", "ORACLES", "POLICIES", "Plan", "SimResult", "StepCost", "WorkUnit", "make_plan",
           "predict_lengths", "simulate", "spearman"]
