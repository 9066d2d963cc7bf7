"""Sums asked in plain English, for a pretrained chat model.

The prompt is one chat message (``What is 38 + 7? ...``) that goes through the model's chat
template; the verifier reads the last number of the response, the answer extraction that
lm-evaluation-harness calls *flexible* for GSM8K. A chat model that answers in a sentence
("38 + 7 equals 45.") is right; one that keeps talking past its answer, or runs out of
tokens, is not. The task has no character alphabet: it needs a model that already speaks
(``model.path``), and refuses to train one from scratch.
"""
from __future__ import annotations

import random
import re

from rhymerl.tasks.base import Problem, Task

_NUMBER = re.compile(r"-?\d[\d,]*")


def last_number(text: str) -> int | None:
    """The last integer written in ``text`` (thousands commas allowed), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return int(found[-1].replace(",", ""))
    except ValueError:
        return None


class ChatSumsTask(Task):
    name = "chat_sums"
    alphabet = ""  # no character model: chat tasks need a pretrained model
    chat = True

    def __init__(self, max_value: int = 20, max_terms: int = 3) -> None:
        self.max_value, self.max_terms = max_value, max_terms

    def make_problem(self, rng: random.Random) -> Problem:
        # Two terms mostly, three sometimes: some answers take a step more than others.
        k = 2 if rng.random() < 0.7 else self.max_terms
        terms = [rng.randint(1, self.max_value) for _ in range(k)]
        question = " + ".join(map(str, terms))
        prompt = [{"role": "user", "content": f"What is {question}? End your reply with the number."}]
        total = sum(terms)
        return Problem(prompt=prompt, ground_truth=str(total), solution=f"{question} = {total}")

    def score(self, response: str, ground_truth: str) -> float:
        return float(last_number(response) == int(ground_truth))
