"""What a config field may hold, and what it is for, written on the field itself.

A field declared with :func:`setting` carries its valid range, whether it says where a run
executes rather than what it learns (``placement``: it may change when a run continues), and
whether the vLLM proposer reads it (``proposer``: sent in ``additional_config``). One walk over
the dataclasses (:func:`marked`) gives each reader its keys, so a new key is its field and
its consumer, and no list of key names is kept anywhere else.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Range:
    """A numeric field's valid values: what the error says, and the check."""

    what: str
    ok: Callable[[Any], bool]


POSITIVE = Range("> 0", lambda v: v > 0)
NON_NEGATIVE = Range(">= 0", lambda v: v >= 0)
ZERO_IS_OFF = Range(">= 0 (0: off)", lambda v: v >= 0)
ZERO_IS_LAST_STEP = Range(">= 0 (0: the last step only)", lambda v: v >= 0)
ZERO_IS_SYNCHRONOUS = Range(">= 0 (0: synchronous)", lambda v: v >= 0)
ZERO_IS_AUTOMATIC = Range(">= 0 (0: automatic)", lambda v: v >= 0)
AT_LEAST_ONE = Range(">= 1", lambda v: v >= 1)
ABOVE_ONE_DUAL_CLIP = Range("> 1 (dual-clip)", lambda v: v > 1)
PROBABILITY_ABOVE_0 = Range("in (0, 1]", lambda v: 0 < v <= 1)
FRACTION = Range("in [0, 1]", lambda v: 0 <= v <= 1)
FRACTION_BELOW_1 = Range("in [0, 1)", lambda v: 0 <= v < 1)
OFF_OR_AT_LEAST_ONE = Range("-1 (off) or >= 1", lambda v: v == -1 or v >= 1)


def setting(default: Any = MISSING, *, range: Range | None = None, placement: bool = False,  # noqa: A002
            proposer: bool = False, default_factory: Any = MISSING) -> Any:
    """A dataclass field with its rules (see the module docstring)."""
    metadata: dict[str, Any] = {}
    if range is not None:
        metadata["range"] = range
    if placement:
        metadata["placement"] = True
    if proposer:
        metadata["proposer"] = True
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def marked(cls: type, rule: str, prefix: str = "") -> dict[str, Any]:
    """Every field of ``cls`` (and of the dataclasses nested in it) that carries ``rule``:
    dotted key -> the rule's value."""
    out: dict[str, Any] = {}
    for f in fields(cls):
        key = prefix + f.name
        if rule in f.metadata:
            out[key] = f.metadata[rule]
        if f.default_factory is not MISSING and is_dataclass(f.default_factory):
            out.update(marked(f.default_factory, rule, key + "."))
    return out
