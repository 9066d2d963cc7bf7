"""The checks a lent GPU machine runs (scripts/gpu_check.sh): each writes a row of a JSON report.

1. native: our decoder against transformers' on CUDA (fp32 and bf16 logits), and our engine's
   greedy tokens with HistoSpec equal to plain greedy (the lossless claim, bit for bit).
2. vllm (where vLLM imports): a tiny Llama in bf16, greedy identity with HistoSpec as vLLM's
   proposer, the T=1 two-sample test against vLLM without speculation (512 samples), and one
   `bench spec --engine vllm`-style timing row.
Usage: python scripts/gpu_check.py REPORT.json
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch


def native(tmp: Path) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rhymerl import LLM, SamplingParams
    from rhymerl.model import load_pretrained

    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(tmp / "tiny")
    out = {}
    x = torch.randint(3, 256, (4, 64))
    for dtype in (torch.float32, torch.bfloat16):
        ours = load_pretrained(tmp / "tiny", device="cuda", dtype=dtype)
        ref = hf.to("cuda", dtype)
        with torch.no_grad():
            a, b = ours(x.cuda()).float(), ref(x.cuda()).logits.float()
        out[f"hf_parity_max_abs_{str(dtype).split('.')[-1]}"] = float((a - b).abs().max())
    prompts = [torch.randint(3, 256, (16,)).tolist() for _ in range(32)]
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    plain = LLM(str(tmp / "tiny"), device="cuda", max_model_len=128).generate(prompts, sp, use_tqdm=False)
    spec = LLM(str(tmp / "tiny"), device="cuda", max_model_len=128, speculative={"method": "history", "max_draft": 8})
    keys = [f"p{i}" for i in range(len(prompts))]
    spec.generate(prompts, sp, prompt_keys=keys, use_tqdm=False)  # epoch 1 writes the history
    again = spec.generate(prompts, sp, prompt_keys=keys, use_tqdm=False)
    out["greedy_identical_with_histospec"] = [o.outputs[0].token_ids for o in plain] == \
        [o.outputs[0].token_ids for o in again]
    out["ok"] = out["greedy_identical_with_histospec"] and out["hf_parity_max_abs_float32"] < 1e-3
    return out


def vllm_checks(tmp: Path) -> dict:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return {"skipped": f"vLLM does not import here ({type(e).__name__}: {e}); install the [vllm] extra"}
    from rhymerl.engine.sampling_params import SamplingParams
    from rhymerl.drafting.config import SpecConfig
    from rhymerl.sample_stats import same_distribution
    from rhymerl.vllm.engine import VllmEngine

    path = str(tmp / "tiny")
    prompts = [torch.randint(3, 256, (16,)).tolist() for _ in range(64)]
    keys = [f"p{i}" for i in range(64)]
    plain = VllmEngine(path, max_num_seqs=512, max_model_len=128, dtype="bfloat16")
    hist = VllmEngine(path, max_num_seqs=512, max_model_len=128, dtype="bfloat16",
                      speculative=SpecConfig(method="history", max_draft=8))
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    seeds = list(range(64))
    g_plain = [s.tokens for g in plain.generate(prompts, greedy, seeds) for s in g]
    first = hist.generate(prompts, greedy, seeds, prompt_keys=keys, tag="h1")
    hist.put_history([(k, p, [(1, [s.tokens for s in g], [None])]) for k, p, g in zip(keys, prompts, first)])
    hist.begin(2)
    g_hist = [s.tokens for g in hist.generate(prompts, greedy, seeds, prompt_keys=keys, tag="h2") for s in g]
    t1 = SamplingParams(n=8, temperature=1.0, max_tokens=64)
    earlier = plain.generate(prompts, t1, [s + 100 for s in seeds], tag="e1")
    hist.put_history([(k, p, [(3, [s.tokens for s in g], [None] * 8)]) for k, p, g in zip(keys, prompts, earlier)])
    hist.begin(4)
    t = time.perf_counter()
    a = hist.generate(prompts, t1, [s + 200 for s in seeds], prompt_keys=keys, tag="a")
    spec_s = time.perf_counter() - t
    t = time.perf_counter()
    b = plain.generate(prompts, t1, [s + 300 for s in seeds], tag="b")
    plain_s = time.perf_counter() - t
    fa, fb = [s for g in a for s in g], [s for g in b for s in g]
    test = same_distribution([s.tokens for s in fa], [s.tokens for s in fb])
    row = {"greedy_identical": g_plain == g_hist, "lossless_pvalue_T1": test.p,
           "accepted_per_forward": sum(len(s.tokens) for s in fa) / max(1, sum(s.forwards for s in fa)),
           "tok_s_history": sum(len(s.tokens) for s in fa) / spec_s, "tok_s_plain": sum(len(s.tokens) for s in fb) / plain_s}
    row["ok"] = row["greedy_identical"] and row["lossless_pvalue_T1"] > 1e-3
    plain.close()
    hist.close()
    return row


def main() -> int:
    report: dict = {"cuda": torch.cuda.is_available(), "torch": torch.__version__}
    if torch.cuda.is_available():
        report["device"] = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as d:
        for name, fn in (("native", native), ("vllm", vllm_checks)):
            t = time.perf_counter()
            try:
                report[name] = fn(Path(d))
            except Exception:  # noqa: BLE001 - the report says what broke
                report[name] = {"error": traceback.format_exc(limit=5), "ok": False}
            report[name]["seconds"] = round(time.perf_counter() - t, 1)
    Path(sys.argv[1] if len(sys.argv) > 1 else "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if report.get("native", {}).get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
