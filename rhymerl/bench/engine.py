"""``rhymerl bench engine``: our engine against Hugging Face ``generate`` on the same weights.

Same prompts, same number of new tokens (EOS ignored), sampling at temperature 1, both
measured in this run. Also prints the cost of one forward scoring k tokens per request,
the curve that decides how much speculation can pay on this machine.
"""
from __future__ import annotations

import tempfile
import time
from typing import Any

import torch

from rhymerl.bench.common import print_table, write_report
from rhymerl.engine import LLM, SamplingParams
from rhymerl.model import CausalLM, ModelConfig, save_pretrained

MODELS = {
    "tiny": dict(vocab_size=32, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    "tiny-256": dict(vocab_size=32, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4),
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4),
}


def _hf_generate(hf, prompts: list[list[int]], new_tokens: int) -> float:
    L = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate expects
        ids[i, L - len(p):] = torch.tensor(p)
        att[i, L - len(p):] = 1
    t = time.perf_counter()
    with torch.no_grad():
        hf.generate(input_ids=ids, attention_mask=att, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                    max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    return time.perf_counter() - t


def _ours(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    sp = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=0)
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t


def forward_cost_curve(model: CausalLM, batches: list[int], ks: list[int], context: int = 200) -> list[dict]:
    """Milliseconds of one forward scoring k tokens per request at batch B, after ``context`` cached tokens."""
    from rhymerl.engine.kv_cache import KVCache
    from rhymerl.model import CacheView

    rows = []
    for B in batches:
        cache = KVCache(model.config, B, context + max(ks) + 1, torch.device("cpu"), torch.float32)
        for k in ks:
            ids = torch.randint(0, model.config.vocab_size, (B, k))
            pos = (context + torch.arange(k)).expand(B, k)
            mask = torch.ones(B, 1, k, context + k, dtype=torch.bool)
            view = CacheView(cache.k, cache.v, pos, mask)
            with torch.inference_mode():
                for _ in range(3):
                    model(ids, pos, view)
                n, t = 0, time.perf_counter()
                while n < 10 or time.perf_counter() - t < 0.3:
                    model(ids, pos, view)
                    n += 1
            rows.append({"batch": B, "k": k, "ms": (time.perf_counter() - t) / n * 1000})
    base = {r["batch"]: r["ms"] for r in rows if r["k"] == 1}
    for r in rows:
        r["rel_to_k1"] = r["ms"] / base[r["batch"]]
    return rows


def run(json_path: str | None = None, models: list[str] | None = None, batches: list[int] | None = None,
        new_tokens: int = 128, quick: bool = False) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    models = models or ["tiny", "100m"]
    batches = batches or [1, 16, 64]
    rows: list[dict[str, Any]] = []
    for name in models:
        cfg = ModelConfig(**MODELS[name])
        m = CausalLM(cfg)
        m.init_weights(0)
        with tempfile.TemporaryDirectory() as d:
            save_pretrained(m, d)
            hf = AutoModelForCausalLM.from_pretrained(d).eval()
        n_new = new_tokens if name != "100m" else min(new_tokens, 32)
        for B in batches:
            g = torch.Generator().manual_seed(B)
            prompts = [torch.randint(3, cfg.vocab_size, (int(torch.randint(16, 48, (1,), generator=g)),),
                                     generator=g).tolist() for _ in range(B)]
            llm = LLM(m, max_num_seqs=max(B, 1), max_model_len=64 + n_new)
            _ours(llm, prompts[:2], 4)  # warm-up
            _hf_generate(hf, prompts[:2], 4)
            reps = 1 if quick else 2
            ours_s = hf_s = float("inf")
            for _ in range(reps):  # in turn: this machine's speed drifts between runs
                ours_s = min(ours_s, _ours(llm, prompts, n_new))
                hf_s = min(hf_s, _hf_generate(hf, prompts, n_new))
            toks = B * n_new
            rows.append({"model": name, "params_m": round(sum(p.numel() for p in m.parameters()) / 1e6, 2),
                         "batch": B, "new_tokens": n_new, "engine_tok_s": toks / ours_s, "hf_tok_s": toks / hf_s,
                         "ratio": hf_s / ours_s})
            print_table(rows[-1:], list(rows[-1]))
    print("\nengine vs HF generate (same weights, same prompts, same lengths):")
    print_table(rows, ["model", "params_m", "batch", "new_tokens", "engine_tok_s", "hf_tok_s", "ratio"])
    tiny = CausalLM(ModelConfig(**MODELS["tiny"]))
    tiny.init_weights(0)
    curve = forward_cost_curve(tiny, [1, 16, 64], [1, 4, 8, 16, 32])
    print("\ncost of one forward scoring k tokens per request (tiny model, 200 cached tokens):")
    print_table(curve, ["batch", "k", "ms", "rel_to_k1"])
    report = write_report(rows, None)
    report["forward_cost"] = curve
    if json_path:
        import json
        from pathlib import Path

        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    return report
