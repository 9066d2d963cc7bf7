"""Reward functions keyed by ``data_source``, with verl's signature.

``compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict``; a
dict must hold ``"score"`` and may add named values that are averaged into metrics.
A reward function that raises never kills a run: the sample gets 0 and the error is
recorded (``RewardResult.error``) so it shows in the metrics and the log.
"""
from __future__ import annotations

import importlib.util
import math
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rhymerl.rewards.math import math_compute_score
from rhymerl.tasks import TASKS

RewardFn = Callable[[str, str, Any, dict[str, Any]], "float | dict[str, Any]"]


@dataclass
class RewardResult:
    score: float
    extra: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    timed_out: bool = False


@dataclass(frozen=True)
class RewardCall:
    """One response to score (what crosses to the reward pool's processes)."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)
    where: str = ""  # names the row in errors ("prompt 17 sample 3")


@dataclass(frozen=True)
class RewardSpec:
    """How to build a :class:`RewardRegistry` in another process: the built-in verifiers, plus
    ``fn_name`` from the user's ``reward_file`` for the data sources in ``sources``."""

    reward_file: str | None = None
    fn_name: str = "compute_score"
    sources: tuple[str, ...] = ()

    def user_fn_name(self) -> str:
        """How errors name the user's function."""
        return f"{self.fn_name!r} from {self.reward_file}"

    def build(self) -> "RewardRegistry":
        reg = RewardRegistry()
        if self.reward_file:
            fn = load_reward_file(self.reward_file, self.fn_name)
            for src in self.sources:
                reg.register(src, fn, name=self.user_fn_name())
        return reg


class RewardRegistry:
    """Maps ``data_source`` to a reward function; unknown sources fall back to ``default``."""

    def __init__(self, default: RewardFn | None = math_compute_score) -> None:
        self._fns: dict[str, RewardFn] = {}
        self._names: dict[str, str] = {}
        self.default = default
        for cls in TASKS.values():
            task = cls()
            self.register(task.data_source, lambda ds, s, gt, ei, _t=task: _t.score(s, str(gt)),
                          name=f"{cls.__name__}.score")

    def register(self, data_source: str, fn: RewardFn, *, name: str | None = None) -> None:
        self._fns[data_source] = fn
        self._names[data_source] = name or getattr(fn, "__name__", repr(fn))

    def name_for(self, data_source: str) -> str:
        """The reward function's name, for errors."""
        if data_source in self._names:
            return self._names[data_source]
        return getattr(self.default, "__name__", repr(self.default))

    def fn_for(self, data_source: str) -> RewardFn:
        fn = self._fns.get(data_source, self.default)
        if fn is None:
            raise KeyError(f"no reward function for data_source {data_source!r} and no default")
        return fn

    def score(self, data_source: str, solution_str: str, ground_truth: Any,
              extra_info: dict[str, Any] | None = None, *, where: str = "") -> RewardResult:
        """Score one response; an exception becomes reward 0 with ``error`` naming ``where``."""
        try:
            out = self.fn_for(data_source)(data_source, solution_str, ground_truth, extra_info or {})
            extra: dict[str, float] = {}
            if isinstance(out, dict):
                if "score" not in out:
                    raise ValueError(f"reward dict has no 'score' key (keys: {sorted(out)})")
                extra = {k: float(v) for k, v in out.items() if k != "score" and isinstance(v, (int, float))}
                out = out["score"]
            score = float(out)
            # NaN or inf would turn the group's advantages (and the update) into NaN: an error, scored 0
            if not math.isfinite(score):
                raise ValueError(f"returned a non-finite score ({score})")
            return RewardResult(score, {k: v for k, v in extra.items() if math.isfinite(v)})
        except Exception as e:  # noqa: BLE001 - any user error must be contained
            tb = traceback.format_exception_only(type(e), e)[-1].strip()
            return RewardResult(0.0, error=f"{where or data_source}: reward function "
                                           f"{self.name_for(data_source)} raised {tb}")

    def score_many(self, calls: list[RewardCall]) -> list[RewardResult]:
        """Score every call here, in this process and thread (no time bound: see ``RewardPool``)."""
        return [self.score(c.data_source, c.solution_str, c.ground_truth, c.extra_info, where=c.where)
                for c in calls]


def load_reward_file(path: str | Path, name: str = "compute_score") -> RewardFn:
    """Load ``name`` from a user's Python file (verl's ``custom_reward_function.path``)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"reward file {path} not found")
    spec = importlib.util.spec_from_file_location(f"rhymerl_user_reward_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"{path}: no callable {name!r}")
    return fn
