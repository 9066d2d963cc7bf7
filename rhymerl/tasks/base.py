"""What a built-in task is: a seeded problem generator with a verifier."""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One generated problem: the prompt, what the verifier checks against, and a worked solution."""

    prompt: str | list[dict[str, str]]  # text, or chat messages for the model's chat template
    ground_truth: str
    solution: str  # a correct response, used as SFT data; one of several valid ones


class Task(ABC):
    """A synthetic reasoning task with a verifiable reward."""

    name: str
    alphabet: str  # every character a prompt or response of this task may contain
    chat: bool = False  # prompts are chat messages for a pretrained model (no SFT base from scratch)

    @abstractmethod
    def make_problem(self, rng: random.Random) -> Problem:
        """Draw one problem; the solution's working is itself drawn, so answers vary."""

    @abstractmethod
    def score(self, response: str, ground_truth: str) -> float:
        """1.0 if the response's final answer is verified correct, else 0.0."""

    def unanswered_solution(self, problem: Problem) -> str:
        """The working without the final answer line the verifier reads (SFT's unanswered examples)."""
        return "\n".join(problem.solution.splitlines()[:-1])

    @property
    def data_source(self) -> str:
        return f"rhymerl/{self.name}"
