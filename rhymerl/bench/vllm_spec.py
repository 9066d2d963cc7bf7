"""``rhymerl bench spec --engine vllm``: speculative methods inside vLLM on the same prompts.

Each method gets a vLLM engine of its own; every engine generates epochs 1..E of the same
prompts, each epoch with its own seeds (as RL draws them), and the history methods draft from
the prompts' earlier epochs. An epoch is timed in rounds, round r on a cohort of prompts of its
own (so a prompt's epoch 1 is the first time any engine sees it, for every round); in each round
the engines run in turn (plain first), so each row's ``speedup`` is against plain vLLM timed in
the same round. Per row: tokens per sequence per
forward (machine-independent), tokens/s, greedy identity against plain vLLM on the same prompts,
and the p-value of the two-sample test (first tokens, lengths, rewards) against plain vLLM's samples
of that epoch (:func:`rhymerl.sample_stats.same_distribution`; another seed, so the two samples are
independent).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rhymerl.bench.common import paired_ratio, print_table, write_report
from rhymerl.drafting.config import SpecConfig
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.sample_stats import same_distribution

# Every method gets the same draft budget (vLLM's num_speculative_tokens): 8. ``history_ungated``:
# HistoSpec drafting as far as the index is confident, without the cost cutoff (vllm/draft_cutoff.py).
METHODS: dict[str, SpecConfig] = {
    "ngram": SpecConfig(method="ngram", index_draft_tokens=8, prompt_lookup_min=2, prompt_lookup_max=5),
    "suffix": SpecConfig(method="suffix", index_draft_tokens=8),
    "history": SpecConfig(method="history", index_draft_tokens=8),
    "history_ungated": SpecConfig(method="history", index_draft_tokens=8, gate=False),
}
PEER = "suffix"  # vLLM's own method the others are compared with round by round (vs_suffix columns)


@dataclass
class Cohort:
    """Prompts every engine sees for the first time at epoch 1 (so no method drafts from an
    earlier round's responses to them, the trap of timing one prompt set round after round)."""

    ids: list[list[int]]
    keys: list[str]
    tok: Any
    task: Any
    truths: list[str]


def _prompts(model: str, n: int, seed: int = 0, tag: str = "p", task: str = "arith") -> Cohort:
    from rhymerl.tasks import get_task
    from rhymerl.tokenizer import encode_prompt, load_tokenizer

    tok, task, rng = load_tokenizer(model), get_task(task), random.Random(seed)
    problems = [task.make_problem(rng) for _ in range(n)]
    return Cohort([encode_prompt(tok, p.prompt) for p in problems], [f"{tag}{i}" for i in range(n)], tok, task,
                  [p.ground_truth for p in problems])


def _epoch(engine, prompts, keys, params, seed: int) -> tuple[list[list[Any]], float]:
    t = time.perf_counter()
    got = engine.generate(prompts, params, [seed * 100_003 + p for p in range(len(prompts))], prompt_keys=keys,
                          tag=f"e{seed}")
    return got, time.perf_counter() - t


def run(json_path: str | None = None, *, quick: bool = False, model: str | None = None, prompts: int = 64,
        n: int = 8, max_tokens: int = 160, temperatures: tuple[float, ...] = (1.0,), epochs: int = 3,
        methods: tuple[str, ...] | None = None, max_model_len: int = 256, rounds: int = 5,
        top_p: float = 1.0, width: str | None = None, task: str = "arith",
        max_num_seqs: int | None = None) -> list[dict[str, Any]]:
    """``max_num_seqs``: sequences in flight (default: every sample of the cohort, up to 256)."""
    from rhymerl.bench.spec import _default_model
    from rhymerl.model.gguf import resolve_model
    from rhymerl.vllm.engine import VllmEngine

    model = str(resolve_model(model)) if model else _default_model()
    if width is not None:  # the same policy at a larger model's cost per forward
        model = _widened(model, width)
    names = [m for m in (methods or tuple(METHODS)) if m != "none"]
    unknown = sorted(set(names) - set(METHODS))
    if unknown:
        raise ValueError(f"bench spec --engine vllm: unknown methods {unknown} (valid: {['none'] + list(METHODS)})")
    if "suffix" in names and importlib.util.find_spec("arctic_inference") is None:
        print("suffix: skipped (vLLM's suffix method needs arctic-inference: pip install arctic-inference)")
        names.remove("suffix")
    if quick:
        prompts, epochs, rounds = min(prompts, 32), min(epochs, 2), 1
    batch = max_num_seqs or min(256, prompts * n)
    plain = VllmEngine(model, max_num_seqs=batch, max_model_len=max_model_len, seed=0)
    engines = {m: VllmEngine(model, max_num_seqs=batch, max_model_len=max_model_len, speculative=METHODS[m], seed=0)
               for m in names}
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens)
    check = _prompts(model, prompts, seed=0, tag="g", task=task)  # prompts of their own: no round's cohort is seen early
    plain_greedy, _ = _epoch(plain, check.ids, check.keys, greedy, seed=0)
    identical = {m: [s.tokens for g in _epoch(e, check.ids, check.keys, greedy, seed=0)[0] for s in g] ==
                 [s.tokens for g in plain_greedy for s in g] for m, e in engines.items()}
    rows: list[dict[str, Any]] = []
    past: dict[tuple, list] = {}  # (method, prompt key) -> its epochs' responses
    for t, temperature in enumerate(temperatures):
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens)
        # Round r of every epoch runs cohort r: its epoch 1 is the first time any engine sees it.
        cohorts = [_prompts(model, prompts, seed=1 + t * rounds + r, tag=f"t{t}r{r}p", task=task)
                   for r in range(rounds)]
        for epoch in range(1, epochs + 1):
            rows += _epoch_rounds(plain, engines, cohorts, params, epoch, past, identical)
    plain.close()
    for e in engines.values():
        e.close()
    for row in rows:
        row.update(batch=batch, top_p=top_p)
    print_table(rows, ["engine", "method", "batch", "epoch", "temperature", "top_p", "rounds", "accepted_per_forward",
                       "drafted_per_forward", "tok_s", "speedup", "speedup_lo", "speedup_hi", "vs_" + PEER,
                       "vs_" + PEER + "_lo", "vs_" + PEER + "_hi", "accuracy", "mean_len", "greedy_identical",
                       "lossless_pvalue", "propose_share"])
    write_report(rows, json_path, {"model": model, "task": task, "prompts": prompts, "n": n, "max_tokens": max_tokens,
                                   "rounds": rounds, "top_p": top_p})
    return rows


def _widened(model: str, width: str) -> str:
    """``model`` zero-padded to the named width (rhymerl.model.widen), written once under
    ``checkpoints/widened/``, keyed by the source's file digests (never inside a run's
    checkpoint, whose manifest lists exactly its files)."""
    from rhymerl.model.widen import get_width, parameter_count, widen_checkpoint
    from rhymerl.training.checkpoint import file_digests

    key = hashlib.sha256(json.dumps(file_digests(Path(model)), sort_keys=True).encode()).hexdigest()[:12]
    dst = Path("checkpoints") / "widened" / f"{width}-{key}"
    if not (dst / "model.safetensors").exists():
        widen_checkpoint(model, dst, get_width(width))
    print(f"model: {model} widened to {parameter_count(dst) / 1e6:.1f}M parameters ({dst}): the same logits, "
          f"a larger model's forward")
    return str(dst)


def _push(eng, m: str, cohort: Cohort, past: dict) -> None:
    """The history a trainer would push before this epoch: the prompts' earlier epochs."""
    kept = METHODS[m].history_epochs
    eng.put_history([(k, p, past.get((m, k), [])[-kept:]) for k, p in zip(cohort.keys, cohort.ids)])


def _epoch_rounds(plain, engines: dict, cohorts: list[Cohort], params, epoch: int, past: dict,
                  identical: dict) -> list[dict[str, Any]]:
    """One epoch timed in rounds, round r on cohort r: plain vLLM, then every method (in an
    order rotated by round), on fresh seeds; a method's speed-up is per round against that
    round's plain run (the machine's drift falls on both), reported as the median and range.
    Tokens per forward and drafted tokens are summed over the rounds; the lossless test and
    the accuracy are round 1's."""
    temperature = params.temperature
    seed0 = 1000 * epoch + int(temperature * 100)
    names = list(engines)
    speed: dict[str, list[float]] = {m: [] for m in ["none"] + names}
    first: dict[str, tuple] = {}
    share: dict[str, float] = {}
    counts: dict[str, list[int]] = {m: [0, 0, 0] for m in ["none"] + names}  # tokens, forwards, drafted
    for r, cohort in enumerate(cohorts):
        seed = seed0 + 100_000 * r
        base, base_s = _epoch(plain, cohort.ids, cohort.keys, params, seed=seed + 7)  # an independent sample
        base_rate = sum(len(s.tokens) for g in base for s in g) / base_s
        speed["none"].append(1.0)
        first.setdefault("none", (base, base_s, base_rate))
        _count(counts["none"], base, 0)
        for m in names[r % max(1, len(names)):] + names[: r % max(1, len(names))]:
            eng, ours = engines[m], METHODS[m].method == "history"
            if ours:
                _push(eng, m, cohort, past)
            before = eng.proposer_counters() if ours else {}
            got, secs = _epoch(eng, cohort.ids, cohort.keys, params, seed=seed)
            after = eng.proposer_counters() if ours else {}
            share[m] = share.get(m, 0.0) + (after.get("propose_s", 0.0) - before.get("propose_s", 0.0)) / secs
            _count(counts[m], got, after.get("drafted", 0) - before.get("drafted", 0))
            speed[m].append(sum(len(s.tokens) for g in got for s in g) / secs / base_rate)
            first.setdefault(m, (got, secs, base_rate))
            if ours:  # these responses join the cohort's next epochs' drafts
                for k, g in zip(cohort.keys, got):
                    past.setdefault((m, k), []).append((epoch, [s.tokens for s in g], [None] * len(g)))
    for m in names:
        if METHODS[m].method == "history":
            engines[m].begin(epoch + 1)
    tok, task, truths = cohorts[0].tok, cohorts[0].task, cohorts[0].truths
    base, base_s, base_rate = first["none"]
    base_tokens = [s.tokens for g in base for s in g]
    base_rewards = _rewards(base, tok, task, truths)
    out = [_row("none", epoch, temperature, base, base_s, base_rate, True, None, tok, task, truths)]
    for m in names:
        got, secs, rate0 = first[m]
        tokens = [s.tokens for g in got for s in g]
        test = same_distribution(tokens, base_tokens, rewards_a=_rewards(got, tok, task, truths),
                                 rewards_b=base_rewards)
        out.append(_row(m, epoch, temperature, got, secs, rate0, identical[m], test.p, tok, task, truths))
        if METHODS[m].method == "history":
            out[-1]["propose_share"] = round(share[m] / len(cohorts), 3)
            out[-1]["drafted_per_forward"] = round(counts[m][2] / max(1, counts[m][1]), 2)
        out[-1].update(p_tokens=round(test.p_tokens, 4), p_length=round(test.p_length, 4),
                       p_reward=round(test.p_reward, 4))  # the parts of lossless_pvalue
    for row in out:
        got = sorted(speed[row["method"]])
        c = counts[row["method"]]
        row.update(rounds=len(cohorts), speedup=round(float(np.median(got)), 3), speedup_lo=round(got[0], 3),
                   speedup_hi=round(got[-1], 3), accepted_per_forward=round(c[0] / max(1, c[1]), 3))
        if PEER in speed and row["method"] not in ("none", PEER):
            row.update(paired_ratio(speed[row["method"]], speed[PEER], "vs_" + PEER, digits=3))
    return out


def _count(acc: list[int], got, drafted: int) -> None:
    acc[0] += sum(len(s.tokens) for g in got for s in g)
    acc[1] += sum(s.forwards for g in got for s in g)
    acc[2] += drafted


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
