"""The checks a lent GPU machine runs (``scripts/gpu_check.sh``), from the source tree with that
machine's own torch: nothing is installed, nothing is downloaded.

Phases, each bounded by its own deadline and written to the JSON report as it ends (a run cut
short still leaves every finished phase on disk):

1. ``env``: torch, CUDA, the device, which compiled cores loaded (or the Python ones).
2. ``parity``: our decoder's logits against transformers' on the same weights, fp32 and bf16.
3. ``base``: the arith task's model scaled up (~180M parameters on a GPU, so a decode step is
   memory-bound), trained for a bounded time; and the task's small draft model.
4. ``identity``: greedy tokens with HistoSpec (after two epochs of history) equal plain greedy,
   in the run's dtype; with ``invariant`` numerics, the same tokens at batch 4 and batch 64.
5. ``speed``: ``rhymerl bench spec`` on the trained base: two epochs of history, then epoch 3
   at T=1 with 64 and 256 requests in flight, plain decoding vs HistoSpec (path, tree) vs the
   draft model, rounds timed in turn (tokens per forward, tok/s, speed-up with an interval).
6. ``vllm``: whether vLLM imports; where it does not (the lent machine has none, and its wheel
   cannot travel) the rows say so and why.

``--dry-run``: the same phases on the CPU with tiny sizes and float32 (a CI test runs it with
pip blocked and the project not installed), so the script works the day a GPU is lent.

Usage: python scripts/gpu_check.py OUT_DIR [--dry-run] [--budget-s 540]
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the source tree, never an installed copy
    sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Sizes:
    """What a run measures: a GPU's sizes, or a CPU dry run's."""

    device: str
    dtype: str
    model: dict
    sft_steps: int
    sft_batch: int
    sft_lr: float
    sft_minutes: float
    prompts: int  # x 8 samples
    batches: tuple[int, ...]
    reps: int
    deadlines_s: dict
    min_accuracy: float  # the base's held-out greedy accuracy must exceed this (it learnt the task)


GPU = Sizes(device="cuda", dtype="bfloat16",
            model=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                       num_key_value_heads=4),
            sft_steps=1500, sft_batch=64, sft_lr=3e-4, sft_minutes=2.0, prompts=32, batches=(64, 256), reps=5,
            deadlines_s=dict(parity=50, base=180, identity=50, speed=200), min_accuracy=0.2)
DRY = Sizes(device="cpu", dtype="float32",
            model=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1),
            sft_steps=200, sft_batch=16, sft_lr=3e-3, sft_minutes=1.5, prompts=4, batches=(8, 32), reps=1,
            deadlines_s=dict(parity=50, base=150, identity=120, speed=180), min_accuracy=0.0)
MIN_ENDED = 0.5  # the base must end at least this share of its held-out responses itself, not at the cap
MIN_DRAFTED = 1.05  # identity: tokens per forward HistoSpec must reach (identity of nothing drafted proves nothing)


class Deadline(Exception):
    """A phase ran past its deadline (raised by SIGALRM inside it)."""


def _alarm(signum, frame):
    raise Deadline("past its deadline")


def task_config(s: Sizes, out: Path):
    from rhymerl.config import load_config

    over = [f"model.{k}={v}" for k, v in s.model.items()] + [
        f"model.device={s.device}", f"sft.steps={s.sft_steps}", f"sft.batch_size={s.sft_batch}",
        f"sft.lr={s.sft_lr}", f"sft.max_minutes={s.sft_minutes}", "sft.eval_prompts=32",
        "sft.unanswered_share=0",  # a base that answers: this checks the engine, not what RL teaches
        f"sft.output_dir={out / 'base'}"]
    return load_config(None, over)


def env(s: Sizes, work: Path) -> dict:
    import importlib

    import rhymerl

    out = {"rhymerl_from": str(Path(rhymerl.__file__).parent), "torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        out["device_name"] = torch.cuda.get_device_name(0)
    for mod in ("rhymerl.drafting._suffix_core", "rhymerl.scheduling._simulator_core"):
        try:
            importlib.import_module(mod)
            out[mod.rsplit(".", 1)[1]] = "compiled"
        except ImportError as e:
            out[mod.rsplit(".", 1)[1]] = f"python fallback ({e})"
    out["ok"] = s.device != "cuda" or torch.cuda.is_available()
    return out


def parity(s: Sizes, work: Path) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rhymerl.model import load_pretrained

    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(work / "tiny-hf")
    out: dict = {}
    x = torch.randint(3, 256, (4, 64), device=s.device)
    for dtype in (torch.float32, torch.bfloat16):
        ours = load_pretrained(work / "tiny-hf", device=s.device, dtype=dtype)
        ref = hf.to(s.device, dtype)
        with torch.no_grad():
            a, b = ours(x).float(), ref(x).logits.float()
        out[f"max_abs_{str(dtype).split('.')[-1]}"] = float((a - b).abs().max())
    out["ok"] = out["max_abs_float32"] < 1e-3 and out["max_abs_bfloat16"] < 0.25
    return out


def base(s: Sizes, work: Path) -> dict:
    from rhymerl.training.sft import draft_config, run_sft

    cfg = task_config(s, work)
    if s.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # SFT only: the checks below run in the measured dtype
    card = run_sft(cfg, work / "base", progress=False)
    dcfg = draft_config(cfg)
    dcfg.sft.max_minutes = min(0.5, s.sft_minutes)
    dcard = run_sft(dcfg, work / "draft", progress=False)
    return {"params": card["params"], "steps": card["steps"], "train_s": card["train_seconds"],
            "heldout_greedy_accuracy": card["heldout_greedy_accuracy"], "response_length": card["response_length"],
            "draft_params": dcard["params"], "format_ok": card["format_ok"], "ok": base_learnt(card, s),
            "needs": f"held-out greedy accuracy > {s.min_accuracy}, >= {MIN_ENDED:.0%} of responses ended"}


def base_learnt(card: dict, s: Sizes) -> bool:
    """A base that never stops or never answers makes every later phase meaningless."""
    return card["heldout_greedy_accuracy"] > s.min_accuracy and card["format_ok"] >= MIN_ENDED


def drafted_identically(out: dict) -> bool:
    """Identity holds, and something was drafted to hold it over."""
    return (out["greedy_identical_with_histospec"] and out["invariant_identical_batch_4_vs_64"]
            and out["history_accepted_per_forward_all_epochs"] >= MIN_DRAFTED)


def _prompts(s: Sizes, work: Path) -> tuple[list, list[str]]:
    from rhymerl.data.splits import task_splits

    cfg = task_config(s, work)
    rows = task_splits(cfg.data, cfg.seed)[0][: s.prompts]
    return [r.prompt for r in rows], [r.key for r in rows]


def identity(s: Sizes, work: Path) -> dict:
    from rhymerl import LLM, SamplingParams

    prompts, keys = _prompts(s, work)
    path = str(work / "base")
    greedy = SamplingParams(temperature=0.0, max_tokens=160)
    plain = LLM(path, device=s.device, dtype=s.dtype, max_num_seqs=64, max_model_len=256)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    spec = LLM(path, device=s.device, dtype=s.dtype, max_num_seqs=64, max_model_len=256,
               speculative={"method": "history", "index_draft_tokens": 16})
    for epoch in (1, 2):  # history, as RL writes it
        spec.generate(prompts, [SamplingParams(n=8, temperature=1.0, max_tokens=160, seed=epoch * 1000 + i)
                                for i in range(len(prompts))], prompt_keys=keys, step=epoch, use_tqdm=False)
    got = spec.generate(prompts, greedy, prompt_keys=keys, step=3, use_tqdm=False)
    st = spec.engine.stats
    out = {"greedy_identical_with_histospec": [o.outputs[0].token_ids for o in got] == want,
           "history_accepted_per_forward_all_epochs": round((st.generated / max(1, st.decode_rows)), 3)}
    inv = {}
    for batch in (4, 64):  # bitwise the same logits at any batch size: the same sampled tokens
        llm = LLM(path, device=s.device, dtype=s.dtype, max_num_seqs=batch, max_model_len=256, invariant=True)
        outs = llm.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=160, seed=7), use_tqdm=False)
        inv[batch] = [c.token_ids for o in outs for c in o.outputs]
    out["invariant_identical_batch_4_vs_64"] = inv[4] == inv[64]
    out["ok"] = drafted_identically(out)
    return out


def speed(s: Sizes, work: Path) -> dict:
    from rhymerl.bench.spec import run as bench_spec

    rows: list[dict] = []
    for batch in s.batches:
        try:
            rep = bench_spec(None, model=str(work / "base"), draft_model=str(work / "draft"), draft_head=None,
                             prompts=s.prompts, epochs=(3,), max_num_seqs=batch, temperatures=(1.0,), gates=(True,),
                             methods=("none", "histospec_path", "histospec_tree", "draft_model"), reps=s.reps,
                             dtype=s.dtype, task_cfg=task_config(s, work))
        except Deadline:  # the batch sizes measured so far stay in the report
            return {"rows": rows, "cut_at_batch": batch, "ok": bool(rows) and all(r["identical_tokens"] for r in rows)}
        for r in rep["rows"]:
            row = {k: r.get(k) for k in ("max_num_seqs", "method", "accepted_per_forward", "tok_s", "speedup",
                                         "speedup_ci95", "aa_noise", "identical_tokens", "rounds")}
            row["beyond_aa_noise"] = _beyond_noise(row)
            rows.append(row)
    return {"rows": rows, "ok": all(r["identical_tokens"] for r in rows)}


def _beyond_noise(row: dict) -> bool | None:
    """Whether a speed-up differs from 1 by more than the A/A spread of its rounds (plain timed
    against itself): a ratio inside that spread is not a measured speed-up."""
    if row.get("speedup") is None or row.get("aa_noise") is None:
        return None
    return abs(row["speedup"] - 1.0) > row["aa_noise"]


def vllm_rows(s: Sizes, work: Path) -> dict:
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - the reason is the row
        return {"runnable": False, "ok": True,
                "why": f"vLLM does not import here ({type(e).__name__}: {str(e)[:200]}); the lent GPU machine is "
                       "offline and vLLM's CUDA wheel is larger than the 64 MiB that travels with a call"}
    return {"runnable": True, "version": vllm.__version__, "ok": True,
            "note": "vLLM imports: run `rhymerl bench spec --engine vllm` and tests/test_vllm.py here"}


PHASES = (("env", env), ("parity", parity), ("base", base), ("identity", identity), ("speed", speed),
          ("vllm", vllm_rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, float32: the same phases")
    ap.add_argument("--budget-s", type=float, default=490, help="the Python part's wall-clock bound")
    ns = ap.parse_args(argv)
    s = DRY if ns.dry_run else GPU
    out_dir = Path(ns.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_check.json"
    report: dict = {"dry_run": ns.dry_run, "sizes": s.__dict__, "phases": {}}
    t_end = time.monotonic() + ns.budget_s
    signal.signal(signal.SIGALRM, _alarm)
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        for name, fn in PHASES:
            left = t_end - time.monotonic()
            if left < 5 or (name in ("identity", "speed") and not report["phases"].get("base", {}).get("ok")):
                report["phases"][name] = {"skipped": "no time left" if left < 5 else "no base model", "ok": False}
                continue
            t = time.perf_counter()
            signal.alarm(max(1, int(min(left, s.deadlines_s.get(name, left)))))
            try:
                report["phases"][name] = fn(s, work)
            except Exception:  # noqa: BLE001 - the report says what broke; the next phase still runs
                report["phases"][name] = {"error": traceback.format_exc(limit=6), "ok": False}
            finally:
                signal.alarm(0)
            report["phases"][name]["seconds"] = round(time.perf_counter() - t, 1)
            path.write_text(json.dumps(report, indent=1, default=str))
            print(f"[gpu_check] {name}: {json.dumps(report['phases'][name], default=str)[:400]}", flush=True)
    report["ok"] = all(p.get("ok") for p in report["phases"].values())
    path.write_text(json.dumps(report, indent=1, default=str))
    print(f"[gpu_check] report: {path}  ok={report['ok']}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
