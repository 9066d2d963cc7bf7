"""Chained addition with the working written line by line.

``Q:12+7+45`` is answered as ``12+7=19`` / ``19+45=64`` / ``A:64``. The number of operands
is drawn from a long-tailed distribution, so response lengths differ by more than 10x
across prompts yet are predictable per prompt; operands may be added in either order, and
the verifier checks only the value of the final answer.
"""
from __future__ import annotations

import random
import re

from rhymerl.tasks.base import Problem, Task

_ANSWER = re.compile(r"A:(-?\d+)\s*$")


class ArithTask(Task):
    name = "arith"
    alphabet = "0123456789+=-\nQA:"

    def __init__(self, min_terms: int = 2, max_terms: int = 12, max_value: int = 9) -> None:
        self.min_terms, self.max_terms, self.max_value = min_terms, max_terms, max_value

    def _num_terms(self, rng: random.Random) -> int:
        # Geometric-like tail: most prompts are short, a few are very long (as in math RL).
        n = self.min_terms
        while n < self.max_terms and rng.random() < 0.72:
            n += 1
        return n

    def make_problem(self, rng: random.Random) -> Problem:
        terms = [rng.randint(1, self.max_value) for _ in range(self._num_terms(rng))]
        prompt = "Q:" + "+".join(map(str, terms)) + "\n"
        order = terms if rng.random() < 0.5 else terms[::-1]
        lines, acc = [], order[0]
        for t in order[1:]:
            lines.append(f"{acc}+{t}={acc + t}")
            acc += t
        lines.append(f"A:{acc}")
        return Problem(prompt=prompt, ground_truth=str(sum(terms)), solution="\n".join(lines))

    def score(self, response: str, ground_truth: str) -> float:
        m = _ANSWER.search(response.strip())
        return float(m is not None and int(m.group(1)) == int(ground_truth))
