"""Data parallelism, one rank's side: how a rank's copy of the policy is held (replicated or
sharded) and its gradients reduced, registered by name (``trainer.strategy``)."""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

from torch import nn


class Strategy:
    """How a rank's copy of the policy is held and its gradients reduced."""

    def wrap(self, model: nn.Module, *, trainable: bool) -> nn.Module:
        raise NotImplementedError

    def grad_sync(self, model: nn.Module) -> Callable[[bool], ContextManager[None]]:
        """``grad_sync(last)``: the context of a micro-batch's backward (reduce on the last only)."""
        raise NotImplementedError


class DDPStrategy(Strategy):
    """Replicated parameters and optimizer state; gradients all-reduced (averaged)."""

    def wrap(self, model: nn.Module, *, trainable: bool) -> nn.Module:
        if not trainable:
            return model  # a frozen copy (the reference model) needs no reduction
        from torch.nn.parallel import DistributedDataParallel

        # No buffers to broadcast (RoPE tables are computed alike on every rank), and without
        # the broadcast a forward is not a collective: ranks may run different numbers of them.
        return DistributedDataParallel(model, forward_sync_buffers=False)

    def grad_sync(self, model: nn.Module) -> Callable[[bool], ContextManager[None]]:
        return lambda last: contextlib.nullcontext() if last else model.no_sync()


class FSDPStrategy(Strategy):
    """FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded; each decoder
    layer gathered for its forward and backward, then freed."""

    def wrap(self, model: nn.Module, *, trainable: bool) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)  # the root holds the embeddings, the final norm and the (tied) head
        return model

    def grad_sync(self, model: nn.Module) -> Callable[[bool], ContextManager[None]]:
        @contextlib.contextmanager
        def ctx(last: bool):
            model.set_requires_gradient_sync(last)
            yield

        return ctx


STRATEGIES: dict[str, type[Strategy]] = {"fsdp": FSDPStrategy, "ddp": DDPStrategy}


def get_strategy(name: str) -> Strategy:
    """The registered strategy ``name``; an unknown name lists the valid ones."""
    if name not in STRATEGIES:
        raise ValueError(f"trainer.strategy {name!r} is not one of {sorted(STRATEGIES)}")
    return STRATEGIES[name]()
