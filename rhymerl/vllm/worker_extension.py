"""Methods rhymerl adds to each vLLM worker (``worker_extension_cls``), reached from the engine's
caller by ``collective_rpc``: new policy and draft-model weights, the history a step drafts from,
the proposer's counters, and the sampler correction's state."""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

RELOAD_LOG = "vllm.model_executor.model_loader.reload.layerwise"


class ExpectedUnloaded(logging.Filter):
    """Drops vLLM's reload warning for layers a push leaves alone on purpose: a rotary table is
    computed from the config, and an Eagle3 head's embedding is the policy's (its sync loads it).
    Any other layer a push fails to reach is still reported."""

    def __init__(self, layers: tuple[str, ...]) -> None:
        super().__init__()
        self.messages = {f"{name}: Failed to load weights" for name in layers}

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.messages


@contextlib.contextmanager
def expected_unloaded(*layers: str) -> Iterator[None]:
    log, keep = logging.getLogger(RELOAD_LOG), ExpectedUnloaded(layers)
    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)


def _reload(vllm_config: Any, model: Any, named: dict) -> list[str] | None:
    """vLLM's layerwise in-place reload (as ``reload_weights`` does it), keeping what its model's
    ``load_weights`` reports loaded: returns the model's parameters the push left alone, or None
    where the model reports nothing (vLLM's Eagle3 drafter: its push is checked by digest)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    want = {name for name, _ in model.named_parameters()}
    with set_current_vllm_config(vllm_config):
        initialize_layerwise_reload(model)
        loaded = model.load_weights(iter(named.items()))
        finalize_layerwise_reload(model, vllm_config.model_config)
    return None if loaded is None else sorted(want - set(loaded))


class RolloutExtension:
    """Mixed into vLLM's worker class: ``self`` is the worker (``self.model_runner``)."""

    def rhymerl_load_weights(self, blob: bytes) -> dict[str, Any]:
        """Copy Hugging Face-named weights (a safetensors blob: tensors cross vLLM's RPC as bytes)
        into the running model; returns how many were sent and which of the model's parameters
        the push did not load (the caller refuses a partial push)."""
        from safetensors.torch import load

        named = load(blob)
        # vLLM's in-place reload: layers whose weights were repacked after loading (its CPU
        # linear kernels) are restored to checkpoint form, loaded, and repacked.
        with expected_unloaded("RotaryEmbedding"):
            missing = _reload(self.model_runner.vllm_config, self.model_runner.get_model(), named)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as vLLM's own reload
            getattr(self.model_runner, reset, lambda: None)()
        return {"sent": len(named), "missing": missing}

    def _rhymerl_draft_model(self) -> Any:
        model = getattr(getattr(self.model_runner, "drafter", None), "model", None)
        if model is None:
            raise RuntimeError("this vLLM engine has no draft model (speculative method eagle3 or draft_model)")
        return model

    def rhymerl_load_draft_weights(self, blob: bytes) -> dict[str, Any]:
        """Copy a draft model's weights, named as its checkpoint (an Eagle3 head's ``midlayer.*``,
        ``fc``...), into the running drafter, in place as for the policy. What the drafter shares
        with the policy (an Eagle3 head's embedding) is the policy's module, updated by its sync,
        and is not counted as missing."""
        from safetensors.torch import load

        named = load(blob)
        model = self._rhymerl_draft_model()
        shared = self._rhymerl_embed_is_policys(model)
        with expected_unloaded("RotaryEmbedding", *(("VocabParallelEmbedding",) if shared else ())):
            missing = _reload(self.model_runner.vllm_config, model, named)
        if shared and missing is not None:
            missing = [n for n in missing if "embed_tokens" not in n]
        return {"sent": len(named), "missing": missing}

    def _rhymerl_embed_is_policys(self, model: Any) -> bool:
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        return embed is not None and embed is self.model_runner.get_model().model.embed_tokens

    def rhymerl_draft_digest(self) -> dict[str, Any]:
        """Per drafter weight, the sum of its entries (to see what a push changed), and whether the
        drafter's embedding is the policy's own module (so a policy sync reaches it). A linear
        layer's sum is read through its forward (W @ 1): vLLM's CPU kernels repack the weight
        and leave the parameter empty."""
        import torch
        from vllm.model_executor.layers.linear import LinearBase

        model = self._rhymerl_draft_model()
        target = self.model_runner.get_model()
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        sums: dict[str, float] = {}
        with torch.no_grad():
            for name, mod in model.named_modules():
                if isinstance(mod, LinearBase):
                    w = next(mod.parameters())
                    out = mod(torch.ones(1, mod.input_size, dtype=w.dtype, device=w.device))
                    sums[f"{name}.weight"] = float((out[0] if isinstance(out, tuple) else out).double().sum())
            for name, p in model.named_parameters():
                sums.setdefault(name, float(p.detach().double().sum()))
        return {"sums": sums, "embed_is_policys": self._rhymerl_embed_is_policys(model),
                "embed_equals_policys": embed is not None and
                bool(torch.equal(embed.weight, target.model.embed_tokens.weight))}

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

    def rhymerl_sampler_status(self) -> dict[str, str]:
        """What the plugin did in this worker, and the probe of the expansion the rejection
        sampler here actually calls (on this worker's device)."""
        from rhymerl.vllm import sampler_fix

        return {"plugin": sampler_fix.status(),
                "probe": sampler_fix.probe_rejection_sampler(self.model_runner.device)}
