"""HistoSpec in a vLLM program that cannot be given a ``speculative_config``: one environment variable.

Frameworks that build their vLLM engines themselves without passing speculation through (TRL's
colocate mode, OpenRLHF's rollout actors) still run vLLM's ``vllm.general_plugins`` in every
process that builds engine arguments. :func:`register` is one: with ``RHYMERL_HISTOSPEC=K`` in the
environment, an engine built without a ``speculative_config`` of its own drafts with
:class:`rhymerl.vllm.HistoSpecProposer`, ``K`` tokens (vLLM's ``num_speculative_tokens``);
``RHYMERL_HISTOSPEC_CONFIG`` (a JSON object) becomes its ``additional_config["rhymerl"]`` under
whatever the program set there. An engine that has a ``speculative_config`` keeps it. The switch
also turns vLLM's statistics on (``LLM`` turns them off by default), since without them the
speculative counters that show what HistoSpec accepted read nothing.

``RHYMERL_VLLM_DTYPE`` (``float32``, ``bfloat16``, ``float16``) sets the dtype of an engine whose
program left it ``auto``: vLLM runs a float32 checkpoint in bfloat16 unless told otherwise, and a
trainer in float32 then sees log-prob gaps near 0.1 that are rounding, not a bug.
"""
from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any

log = logging.getLogger(__name__)

SWITCH = "RHYMERL_HISTOSPEC"
CONFIG = "RHYMERL_HISTOSPEC_CONFIG"
DTYPE = "RHYMERL_VLLM_DTYPE"
DTYPES = ("float32", "bfloat16", "float16")


def dtype_from_environment(env: dict[str, str] | os._Environ = os.environ) -> str | None:
    """The dtype ``RHYMERL_VLLM_DTYPE`` asks for, or None; any other value is refused by name."""
    raw = env.get(DTYPE, "").strip()
    if not raw:
        return None
    if raw not in DTYPES:
        raise ValueError(f"{DTYPE}={raw!r}: expected one of {', '.join(DTYPES)}")
    return raw


def from_environment(env: dict[str, str] | os._Environ = os.environ) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``(speculative_config, additional_config["rhymerl"])`` the environment asks for, or None;
    a malformed value is refused naming the variable."""
    raw = env.get(SWITCH, "").strip()
    if not raw:
        return None
    try:
        k = int(raw)
    except ValueError:
        k = 0
    if k < 1:
        raise ValueError(f"{SWITCH}={raw!r}: expected the number of draft tokens per step, an integer >= 1 (e.g. 8)")
    extra: Any = {}
    if env.get(CONFIG, "").strip():
        try:
            extra = json.loads(env[CONFIG])
        except json.JSONDecodeError as e:
            raise ValueError(f"{CONFIG}: not JSON ({e})") from e
        if not isinstance(extra, dict):
            raise ValueError(f"{CONFIG}: expected a JSON object such as '{{\"history_dir\": \"/shared/h\"}}', "
                             f"got {type(extra).__name__}")
    from rhymerl.vllm.methods import PROPOSER

    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": k}, extra


def apply(args: Any, env: dict[str, str] | os._Environ = os.environ) -> None:
    """Give vLLM engine arguments ``args`` what the environment asks for (see the module docstring)."""
    dtype = dtype_from_environment(env)
    if dtype is not None and args.dtype == "auto":
        args.dtype = dtype
    asked = from_environment(env)
    if asked is None:
        return
    spec, extra = asked
    if args.speculative_config is not None:
        log.info("%s is set, but this engine has a speculative_config of its own: kept", SWITCH)
        return
    args.speculative_config = spec
    args.disable_log_stats = False  # the acceptance counters live in the statistics
    current = dict(args.additional_config or {})
    current["rhymerl"] = {**extra, **dict(current.get("rhymerl") or {})}
    args.additional_config = current


def register() -> None:
    """The ``vllm.general_plugins`` entry point: wraps ``EngineArgs.create_engine_config`` once."""
    if not (os.environ.get(SWITCH) or os.environ.get(DTYPE)):
        return
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "_rhymerl_switch", False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args: Any, **kwargs: Any):
        apply(self)
        return original(self, *args, **kwargs)

    create_engine_config._rhymerl_switch = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config
