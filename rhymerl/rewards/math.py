"""Math answers checked by ``math-verify``: ``\\boxed{...}`` or GSM8K's ``#### n``."""
from __future__ import annotations

import logging
import re
import threading
from typing import Any

_HASH_ANSWER = re.compile(r"####\s*([-+]?[\d,]*\.?\d+)")
logging.getLogger("math_verify").setLevel(logging.ERROR)


def extract_answer(text: str) -> str | None:
    """The final answer of a response: the last ``\\boxed{}`` (balanced braces) or ``#### n``."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        i, depth = start + len("\\boxed{"), 1
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j]
        return None
    m = _HASH_ANSWER.findall(text)
    return m[-1].replace(",", "") if m else None


def math_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                       extra_info: dict[str, Any] | None = None) -> float:
    """1.0 when math-verify finds the response's answer equal to the ground truth.

    math-verify's own timeouts use ``signal.alarm``, which works in a process's main thread
    only: on there (the reward pool's workers run every call in their main thread), off in
    any other thread, where the pool's per-call timeout is the only bound.
    """
    from math_verify import parse, verify

    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    main = threading.current_thread() is threading.main_thread()
    gold = str(ground_truth)
    gold_p = parse(f"${gold}$", parsing_timeout=5 if main else None)
    pred_p = parse(f"${answer}$", parsing_timeout=5 if main else None)
    if not gold_p or not pred_p:
        return 0.0
    return float(verify(gold_p, pred_p, timeout_seconds=5 if main else None))
