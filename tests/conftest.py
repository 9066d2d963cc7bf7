"""Shared fixtures (helpers without fixtures are tests/helpers.py's)."""
from __future__ import annotations

import pytest
import torch

from rhymerl.config import load_config
from rhymerl.model import CausalLM
from tests.helpers import TINY, tiny_model

torch.set_num_threads(2)


@pytest.fixture
def model() -> CausalLM:
    return tiny_model()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """A tiny random model saved as an HF folder (for workers that load one)."""
    from rhymerl.model import save_pretrained

    out = tmp_path_factory.mktemp("tiny_model")
    save_pretrained(tiny_model(), out)
    return str(out)


@pytest.fixture(scope="session")
def base_model(tmp_path_factory) -> str:
    from rhymerl.training.sft import run_sft

    out = tmp_path_factory.mktemp("sft")
    run_sft(load_config(None, TINY), out, progress=False)
    return str(out)
