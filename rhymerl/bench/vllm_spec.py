"""``rhymerl bench spec --engine vllm``: speculative methods inside vLLM on the same prompts.

Each method gets a vLLM engine of its own; every engine generates epochs 1..E of the same
prompts, each epoch with its own seeds (as RL draws them), and the history method drafts from
its previous epoch's responses. In each epoch the engines run in turn (plain first), so each
row's ``speedup`` is against plain vLLM timed in the same round. Per row: tokens per sequence per
forward (machine-independent), tokens/s, greedy identity against plain vLLM on the same prompts,
and the p-value of the two-sample test (first tokens, lengths, rewards) against plain vLLM's samples
of that epoch (:func:`rhymerl.sample_stats.same_distribution`; another seed, so the two samples are
independent).
"""
from __future__ import annotations

import importlib.util
import random
import time
from typing import Any

import numpy as np

from rhymerl.bench.common import print_table, write_report
from rhymerl.drafting.config import SpecConfig
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.sample_stats import same_distribution

# Every method gets the same draft budget (vLLM's num_speculative_tokens): 8.
METHODS: dict[str, SpecConfig] = {
    "ngram": SpecConfig(method="ngram", index_draft_tokens=8, prompt_lookup_min=2, prompt_lookup_max=5),
    "suffix": SpecConfig(method="suffix", index_draft_tokens=8),
    "history": SpecConfig(method="history", index_draft_tokens=8),
}


def _prompts(model: str, n: int, seed: int = 0) -> tuple[list[list[int]], list[str], Any, Any, list[str]]:
    from rhymerl.tasks import get_task
    from rhymerl.tokenizer import encode_prompt, load_tokenizer

    tok, task, rng = load_tokenizer(model), get_task("arith"), random.Random(seed)
    problems = [task.make_problem(rng) for _ in range(n)]
    return ([encode_prompt(tok, p.prompt) for p in problems], [f"p{i}" for i in range(n)], tok, task,
            [p.ground_truth for p in problems])


def _epoch(engine, prompts, keys, params, seed: int) -> tuple[list[list[Any]], float]:
    t = time.perf_counter()
    got = engine.generate(prompts, params, [seed * 100_003 + p for p in range(len(prompts))], prompt_keys=keys,
                          tag=f"e{seed}")
    return got, time.perf_counter() - t


def run(json_path: str | None = None, *, quick: bool = False, model: str | None = None, prompts: int = 64,
        n: int = 8, max_tokens: int = 160, temperatures: tuple[float, ...] = (1.0,), epochs: int = 3,
        methods: tuple[str, ...] | None = None, max_model_len: int = 256, rounds: int = 5) -> list[dict[str, Any]]:
    from rhymerl.bench.spec import _default_model
    from rhymerl.vllm.engine import VllmEngine

    model = model or _default_model()
    names = [m for m in (methods or tuple(METHODS)) if m != "none"]
    if "suffix" in names and importlib.util.find_spec("arctic_inference") is None:
        print("suffix: skipped (vLLM's suffix method needs arctic-inference: pip install arctic-inference)")
        names.remove("suffix")
    if quick:
        prompts, epochs, rounds = min(prompts, 32), min(epochs, 2), 1
    ids, keys, tok, task, truths = _prompts(model, prompts)
    batch = min(256, prompts * n)
    plain = VllmEngine(model, max_num_seqs=batch, max_model_len=max_model_len, seed=0)
    engines = {m: VllmEngine(model, max_num_seqs=batch, max_model_len=max_model_len, speculative=METHODS[m], seed=0)
               for m in names}
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens)
    plain_greedy, _ = _epoch(plain, ids, keys, greedy, seed=0)
    identical = {m: [s.tokens for g in _epoch(e, ids, keys, greedy, seed=0)[0] for s in g] ==
                 [s.tokens for g in plain_greedy for s in g] for m, e in engines.items()}
    rows: list[dict[str, Any]] = []
    past: dict[tuple, list] = {}  # (method, temperature, prompt key) -> its epochs' responses
    for temperature in temperatures:
        params = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens)
        for epoch in range(1, epochs + 1):
            rows += _epoch_rounds(plain, engines, ids, keys, params, epoch, temperature, rounds, past,
                                  (tok, task, truths), identical)
    plain.close()
    for e in engines.values():
        e.close()
    print_table(rows, ["engine", "method", "epoch", "temperature", "rounds", "accepted_per_forward", "tok_s",
                       "speedup", "speedup_lo", "speedup_hi", "accuracy", "mean_len", "greedy_identical",
                       "lossless_pvalue", "propose_share"])
    write_report(rows, json_path, {"model": model, "prompts": prompts, "n": n, "max_tokens": max_tokens,
                                   "rounds": rounds})
    return rows


def _push(eng, m: str, keys: list[str], ids, temperature: float, past: dict) -> None:
    """The history a trainer would push before this epoch (what earlier rounds recorded goes)."""
    kept = METHODS[m].history_epochs
    eng.put_history([(k, p, past.get((m, temperature, k), [])[-kept:]) for k, p in zip(keys, ids)])


def _epoch_rounds(plain, engines: dict, ids, keys, params, epoch: int, temperature: float, rounds: int,
                  past: dict, scoring: tuple, identical: dict) -> list[dict[str, Any]]:
    """One epoch timed in ``rounds`` rounds: each round plain vLLM, then every method (in an
    order rotated by round), on fresh seeds; a method's speed-up is per round against that
    round's plain run (the machine's drift falls on both), reported as the median and range."""
    tok, task, truths = scoring
    seed0 = 1000 * epoch + int(temperature * 100)
    names = list(engines)
    speed: dict[str, list[float]] = {m: [] for m in ["none"] + names}
    first: dict[str, tuple] = {}
    share: dict[str, float] = {}
    for r in range(rounds):
        seed = seed0 + 100_000 * r
        base, base_s = _epoch(plain, ids, keys, params, seed=seed + 7)  # another seed: an independent sample
        base_rate = sum(len(s.tokens) for g in base for s in g) / base_s
        speed["none"].append(1.0)
        first.setdefault("none", (base, base_s, base_rate))
        for m in names[r % max(1, len(names)):] + names[: r % max(1, len(names))]:
            eng, ours = engines[m], METHODS[m].method == "history"
            if ours:
                _push(eng, m, keys, ids, temperature, past)
            before = eng.proposer_counters().get("propose_s", 0.0) if ours else 0.0
            got, secs = _epoch(eng, ids, keys, params, seed=seed)
            if ours:
                share[m] = share.get(m, 0.0) + (eng.proposer_counters().get("propose_s", 0.0) - before) / secs / rounds
            speed[m].append(sum(len(s.tokens) for g in got for s in g) / secs / base_rate)
            first.setdefault(m, (got, secs, base_rate))
    base, base_s, base_rate = first["none"]
    base_tokens = [s.tokens for g in base for s in g]
    base_rewards = _rewards(base, tok, task, truths)
    out = [_row("none", epoch, temperature, base, base_s, base_rate, True, None, tok, task, truths)]
    for m in names:
        got, secs, rate0 = first[m]
        if METHODS[m].method == "history":  # round 1's responses join the next epochs' drafts
            for k, g in zip(keys, got):
                past.setdefault((m, temperature, k), []).append((epoch, [s.tokens for s in g], [None] * len(g)))
            engines[m].begin(epoch + 1)
        tokens = [s.tokens for g in got for s in g]
        test = same_distribution(tokens, base_tokens, rewards_a=_rewards(got, tok, task, truths),
                                 rewards_b=base_rewards)
        out.append(_row(m, epoch, temperature, got, secs, rate0, identical[m], test.p, tok, task, truths))
        out[-1]["propose_share"] = round(share[m], 3) if m in share else None
        out[-1].update(p_tokens=round(test.p_tokens, 4), p_length=round(test.p_length, 4),
                       p_reward=round(test.p_reward, 4))  # the parts of lossless_pvalue
    for row in out:
        got = sorted(speed[row["method"]])
        row.update(rounds=rounds, speedup=round(float(np.median(got)), 3), speedup_lo=round(got[0], 3),
                   speedup_hi=round(got[-1], 3))
    return out


def _rewards(got, tok, task, truths: list[str]) -> list[float]:
    return [task.score(tok.decode(s.tokens, skip_special_tokens=True), truths[p]) for p, g in enumerate(got) for s in g]


def _row(method: str, epoch: int, temperature: float, got, secs: float, base_rate: float, identical: bool,
         pvalue: float | None, tok, task, truths: list[str]) -> dict[str, Any]:
    flat = [(p, s) for p, g in enumerate(got) for s in g]
    tokens = sum(len(s.tokens) for _, s in flat)
    forwards = sum(s.forwards for _, s in flat)
    acc = sum(_rewards(got, tok, task, truths)) / len(flat)
    rate = tokens / secs
    return {"engine": "vllm", "method": method, "epoch": epoch, "temperature": temperature,
            "accepted_per_forward": round(tokens / max(1, forwards), 3), "tok_s": round(rate),
            "speedup": round(rate / base_rate, 3), "accuracy": round(acc, 3), "mean_len": round(tokens / len(flat), 1),
            "greedy_identical": identical, "lossless_pvalue": None if pvalue is None else round(pvalue, 4)}
