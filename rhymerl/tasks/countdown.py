"""Countdown: reach a target from given numbers with + - *, each number used at most once.

``Q:3,5,2>16`` can be answered ``3+5=8`` / ``8*2=16`` / ``A:(3+5)*2`` — or any other
expression the verifier accepts: it parses the final expression with ``ast``, checks the
numbers used against those given, and evaluates it. More numbers mean more steps, so
lengths vary across prompts.
"""
from __future__ import annotations

import ast
import random
import re
from collections import Counter

from rhymerl.tasks.base import Problem, Task

_ANSWER = re.compile(r"A:([0-9+\-*() ]+)\s*$")


def _eval(node: ast.AST, used: list[int]) -> int:
    if isinstance(node, ast.Expression):
        return _eval(node.body, used)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        used.append(node.value)
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        a, b = _eval(node.left, used), _eval(node.right, used)
        return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
    raise ValueError("unsupported expression")


class CountdownTask(Task):
    name = "countdown"
    alphabet = "0123456789+-*=(),>\nQA:"

    def __init__(self, min_numbers: int = 2, max_numbers: int = 8, max_start: int = 12) -> None:
        self.min_numbers, self.max_numbers, self.max_start = min_numbers, max_numbers, max_start

    def make_problem(self, rng: random.Random) -> Problem:
        k = self.min_numbers
        while k < self.max_numbers and rng.random() < 0.65:
            k += 1
        nums = [rng.randint(1, self.max_start) for _ in range(k)]
        pool = [(n, str(n)) for n in nums]
        lines = []
        while len(pool) > 1:
            i, j = rng.sample(range(len(pool)), 2)
            (a, ea), (b, eb) = pool[i], pool[j]
            if a < b:
                (a, ea), (b, eb) = (b, eb), (a, ea)
            op = rng.choice("+-*" if a * b <= 200 else "+-")
            val = a + b if op == "+" else a - b if op == "-" else a * b
            lines.append(f"{a}{op}{b}={val}")
            expr = f"({ea}{op}{eb})" if len(pool) > 2 else f"{ea}{op}{eb}"
            pool = [p for t, p in enumerate(pool) if t not in (i, j)] + [(val, expr)]
        target, expr = pool[0]
        prompt = "Q:" + ",".join(map(str, nums)) + f">{target}\n"
        return Problem(prompt=prompt, ground_truth=f"{target}|{','.join(map(str, nums))}",
                       solution="\n".join(lines + [f"A:{expr}"]))

    def score(self, response: str, ground_truth: str) -> float:
        target_s, nums_s = ground_truth.split("|")
        m = _ANSWER.search(response.strip())
        if m is None:
            return 0.0
        used: list[int] = []
        try:
            value = _eval(ast.parse(m.group(1), mode="eval"), used)
        except (SyntaxError, ValueError, RecursionError):
            return 0.0
        allowed = Counter(int(x) for x in nums_s.split(","))
        return float(value == int(target_s) and not Counter(used) - allowed)
