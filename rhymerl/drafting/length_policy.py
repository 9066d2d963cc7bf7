"""Per-request draft length, adapted to what verification accepted (plain functions)."""
from __future__ import annotations


def additive(current: int, drafted: int, accepted: int, *, start: int = 2, step: int = 2, cap: int = 32) -> int:
    """The paper's rule: +``step`` after a fully accepted draft, back to ``start`` after a rejection."""
    if drafted == 0:
        return max(current, start)
    return min(cap, current + step) if accepted == drafted else start


def multiplicative(current: int, drafted: int, accepted: int, *, start: int = 2, cap: int = 16) -> int:
    """The release's rule: double after a fully accepted full-length draft, else halve (>= 1)."""
    if drafted == 0:
        return max(current, start)
    if accepted == drafted and drafted >= current:
        return min(cap, current * 2)
    return max(1, current // 2)


def longest(current: int, drafted: int, accepted: int, *, cap: int = 32) -> int:
    """No ramp: every draft as long as the index's confident match (``min_prob``) allows, up to
    the cap. For engines that verify a draft's tokens at little extra cost per token (vLLM)."""
    return cap


POLICIES = {"additive": (additive, 32), "multiplicative": (multiplicative, 16), "longest": (longest, 32)}

def resolve(name: str, engine: str = "native") -> str:
    """The policy ``name`` means on ``engine`` (``auto``: the engine's own default, from its
    :class:`rhymerl.rollout_engines.EngineSpec`)."""
    from rhymerl.rollout_engines import get_engine

    return get_engine(engine).length_policy if name == "auto" else name
