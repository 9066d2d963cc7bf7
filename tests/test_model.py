"""Our decoder against transformers' implementation, and our cache against no cache."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from rhymerl.model import CacheView, load_pretrained, save_pretrained
from tests.helpers import tiny_model

KW = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, vocab_size=100)
ARCHS = {
    "llama": (LlamaConfig, {}),
    "llama3-rope": (LlamaConfig, dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 1024},
                                      rope_theta=500000.0)),
    "qwen2": (Qwen2Config, {}),
    "qwen2-yarn": (Qwen2Config, dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 512})),
    "qwen3": (Qwen3Config, dict(head_dim=32, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_hf_to_ours_and_back(arch, tmp_path):
    cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cls(**KW, **extra)).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    x = torch.randint(0, 100, (3, 24))
    with torch.no_grad():
        ref = hf(x).logits
        assert (ours(x) - ref).abs().max().item() < 1e-4
    save_pretrained(ours, tmp_path / "ours")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert (back(x).logits - ref).abs().max().item() < 1e-4


def test_sharded_checkpoint_roundtrip(tmp_path):
    m = tiny_model()
    save_pretrained(m, tmp_path, max_shard_bytes=50_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    back = load_pretrained(tmp_path)
    x = torch.randint(0, 40, (2, 10))
    with torch.no_grad():
        assert torch.equal(back(x), m(x))


def test_refuses_checkpoint_of_another_model(tmp_path):
    save_pretrained(tiny_model(hidden_size=64), tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    cfg["hidden_size"] = 96
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape mismatch.*embed_tokens"):
        load_pretrained(tmp_path / "a")


def test_refuses_pickled_weights(tmp_path):
    save_pretrained(tiny_model(), tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors only"):
        load_pretrained(tmp_path)


def test_incremental_cache_equals_full_sequence():
    m = tiny_model()
    x = torch.randint(0, 40, (2, 12))
    L, kvh, D = 2, 2, 16
    k = torch.zeros(L, 2, kvh, 32, D)
    v = torch.zeros_like(k)
    with torch.no_grad():
        full = m(x)
        # prefill 7 tokens, then 5 single-token steps
        pos = torch.arange(7).expand(2, 7)
        mask = torch.ones(7, 7, dtype=torch.bool).tril().expand(2, 1, 7, 7)
        out = [m(x[:, :7], pos, CacheView(k, v, pos, mask))]
        for t in range(7, 12):
            p = torch.full((2, 1), t)
            mk = torch.ones(2, 1, 1, t + 1, dtype=torch.bool)
            out.append(m(x[:, t:t + 1], p, CacheView(k, v, p, mk)))
    assert (torch.cat(out, 1) - full).abs().max().item() < 1e-5


@pytest.mark.parametrize("tied", [True, False])
def test_a_widened_checkpoint_computes_the_same_logits_at_the_larger_models_size(tmp_path, tied):
    """Zero padding to 4x the hidden size, a larger MLP and more layers: the logits are the
    original's to the bit, and the parameters are the larger model's."""
    from rhymerl.model.widen import Width, parameter_count, widen_checkpoint

    src = tmp_path / "small"
    save_pretrained(tiny_model(tie_word_embeddings=tied), src)
    wide = widen_checkpoint(src, tmp_path / "wide", Width(hidden_size=256, intermediate_size=512, num_hidden_layers=3))
    ids = torch.randint(3, 40, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load_pretrained(src)(ids), load_pretrained(wide)(ids))
    assert parameter_count(wide) > 10 * parameter_count(src)
    with pytest.raises(ValueError, match="power-of-4"):
        widen_checkpoint(src, tmp_path / "bad", Width(hidden_size=128, intermediate_size=512, num_hidden_layers=3))
