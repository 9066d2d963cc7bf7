"""Methods rhymerl adds to each vLLM worker (``worker_extension_cls``), reached from the engine's
caller by ``collective_rpc``: new policy weights, the history a step drafts from, the proposer's
counters, and the sampler correction's state."""
from __future__ import annotations

from typing import Any


class RolloutExtension:
    """Mixed into vLLM's worker class: ``self`` is the worker (``self.model_runner``)."""

    def rhymerl_load_weights(self, blob: bytes) -> int:
        """Copy Hugging Face-named weights (a safetensors blob: tensors cross vLLM's RPC as bytes)
        into the running model; returns how many were loaded."""
        from safetensors.torch import load

        named = load(blob)
        # vLLM's in-place reload: layers whose weights were repacked after loading (its CPU
        # linear kernels) are restored to checkpoint form, loaded, and repacked.
        self.reload_weights(weights_iterator=iter(named.items()), is_checkpoint_format=True)
        return len(named)

    def _rhymerl_proposer(self) -> Any:
        from rhymerl.vllm.proposer import HistoSpecProposer

        drafter = getattr(self.model_runner, "drafter", None)
        return drafter if isinstance(drafter, HistoSpecProposer) else None

    def rhymerl_put_history(self, rows: list) -> None:
        p = self._rhymerl_proposer()
        if p is not None:
            p.put_history(rows)

    def rhymerl_begin(self, step: int) -> None:
        p = self._rhymerl_proposer()
        if p is not None:
            p.begin(step)

    def rhymerl_counters(self) -> dict[str, float]:
        p = self._rhymerl_proposer()
        return p.counters() if p is not None else {}

    def rhymerl_sampler_status(self) -> str:
        from rhymerl.vllm import sampler_fix

        return sampler_fix.status()
