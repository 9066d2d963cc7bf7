"""Math answers checked by ``math-verify``: ``\\boxed{...}`` or GSM8K's ``#### n``."""
from __future__ import annotations

import logging
import re
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

    math-verify's own timeouts use ``signal.alarm``, which fails outside the main thread,
    so they are off here; the reward workers bound the time instead.
    """
    from math_verify import parse, verify

    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    gold = str(ground_truth)
    gold_p = parse(f"${gold}$", parsing_timeout=None)
    pred_p = parse(f"${answer}$", parsing_timeout=None)
    if not gold_p or not pred_p:
        return 0.0
    return float(verify(gold_p, pred_p, timeout_seconds=None))
