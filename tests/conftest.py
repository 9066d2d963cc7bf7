"""Shared fixtures: tiny random models built in-process (no downloads)."""
from __future__ import annotations

import pytest
import torch

from rhymerl.model import CausalLM, ModelConfig

torch.set_num_threads(2)


def tiny_config(**kw) -> ModelConfig:
    base = dict(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, eos_token_id=2)
    base.update(kw)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, std: float = 0.3, **kw) -> CausalLM:
    """Random weights with a large std so that distributions are far from uniform
    (greedy decoding then has few near-ties)."""
    m = CausalLM(tiny_config(**kw))
    m.init_weights(seed, std=std)
    return m.eval()


@pytest.fixture
def model() -> CausalLM:
    return tiny_model()


def naive_greedy(model: CausalLM, prompt: list[int], n: int) -> list[int]:
    """Reference decoding: recompute the whole sequence every token, no cache."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]
