"""This machine's costs for the whole-step model (:class:`~rhymerl.bench.step_model.LocalCosts`),
measured apart from the runs they predict (``rhymerl bench e2e`` calibrates before and after
them and takes the mean).

Alone: the engine's step curve (this process's threads, and one thread), the trainer's seconds
per token on a batch of the runs' shape, the history drafter's seconds per row. Side by side:
what two processes cost each other when they run at once on the shared cores (memory
bandwidth, caches, cores' clocks and oversubscribed threads), measured rather than derived
from a thread count: an engine beside another (two rollout workers) and an engine beside the
trainer (async RL, the streamed update), with the engine's threads of those runs.
"""
from __future__ import annotations

import copy

import multiprocessing as mp
import os
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:  # the heavy imports stay lazy: `rhymerl bench ...` starts fast
    from rhymerl.config import RolloutSection, RunConfig
    from rhymerl.bench.step_model import LocalCosts

_PROMPT_LEN, _TOKENS = 40, 16


def _engine_loop(model: str, threads: int, batch: int, conn: Any) -> None:
    """A worker-shaped load in its own process: whole ``generate`` calls of a fixed batch, their
    (start, end) on the system's monotonic clock, from the parent's "go" until its "stop"."""
    import torch

    from rhymerl.engine import SamplingParams
    from rhymerl.llm import LLM

    torch.set_num_threads(threads)
    llm = LLM(model, max_num_seqs=batch, max_model_len=_PROMPT_LEN + _TOKENS + 8)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, llm.model.config.vocab_size, size=_PROMPT_LEN).tolist() for _ in range(batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=_TOKENS, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up
    conn.send("ready")
    conn.recv()  # go
    spans = []
    while not conn.poll():
        t = time.monotonic()
        llm.generate(prompts, sp, use_tqdm=False)
        spans.append((t, time.monotonic()))
    conn.send(spans)


class _Engine:
    """One :func:`_engine_loop` process."""

    def __init__(self, model: str, threads: int, batch: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_loop, args=(model, threads, batch, child), daemon=True)
        self.proc.start()

    def ready(self) -> None:
        if self.conn.recv() != "ready":
            raise RuntimeError("calibration engine did not start")

    def go(self) -> None:
        self.conn.send("go")

    def stop(self) -> list[tuple[float, float]]:
        self.conn.send("stop")
        spans = self.conn.recv()
        self.proc.join(timeout=30)
        return spans


def _median_within(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    inside = [b - a for a, b in spans if a >= lo and b <= hi]
    if not inside:
        raise RuntimeError("calibration window too short for one engine call")
    return float(np.median(inside))


def engine_beside_engine(model: str, batch: int, alone_s: float = 2.0, both_s: float = 3.0) -> float:
    """How many times slower a one-thread engine runs while another one-thread engine runs."""
    a, b = _Engine(model, 1, batch), _Engine(model, 1, batch)
    try:
        a.ready()
        b.ready()
        a.go()
        t0 = time.monotonic()
        time.sleep(alone_s)
        b.go()
        t1 = time.monotonic()
        time.sleep(both_s)
        t2 = time.monotonic()
        spans = a.stop()
        b.stop()
    finally:
        for e in (a, b):
            e.proc.kill()
    # the first call after "go" still warms caches: alone from the second on
    alone = _median_within(spans[1:], t0, t1)
    return _median_within(spans, t1, t2) / alone


def engine_beside_trainer(model: str, threads: int, batch: int, train: Callable[[], float],
                          train_alone_s: float, alone_s: float = 2.0, reps: int = 5) -> tuple[float, float]:
    """(engine, trainer) slow-downs while an engine of ``threads`` threads in its own process and
    ``train`` (returning its seconds; alone it takes ``train_alone_s``) run at once."""
    e = _Engine(model, threads, batch)
    try:
        e.ready()
        e.go()
        t0 = time.monotonic()
        time.sleep(alone_s)
        t1 = time.monotonic()
        train_s = float(np.median([train() for _ in range(reps)]))
        t2 = time.monotonic()
        spans = e.stop()
    finally:
        e.proc.kill()
    alone = _median_within(spans[1:], t0, t1)
    return _median_within(spans, t1, t2) / alone, train_s / train_alone_s


def history_draft_s_per_row(model: str, prompts: list[list[int]], params: RolloutSection) -> float:
    """The history drafter's own seconds per decode row, on a third epoch of ``prompts`` (two
    earlier epochs recorded as its history)."""
    from rhymerl.engine import SamplingParams
    from rhymerl.llm import LLM

    llm = LLM(model, max_num_seqs=len(prompts) * params.n, max_model_len=params.max_model_len,
              speculative={"method": "history"})
    keys = [str(i) for i in range(len(prompts))]
    for epoch in (1, 2):
        sp = SamplingParams(n=params.n, temperature=params.temperature, max_tokens=params.max_tokens, seed=epoch)
        llm.generate(prompts, sp, prompt_keys=keys, step=epoch, use_tqdm=False)
    stats = llm.engine.stats
    s0, r0 = stats.draft_s, stats.decode_rows
    sp = SamplingParams(n=params.n, temperature=params.temperature, max_tokens=params.max_tokens, seed=3)
    llm.generate(prompts, sp, prompt_keys=keys, step=3, use_tqdm=False)
    return (stats.draft_s - s0) / max(1, stats.decode_rows - r0)


def mean_costs(a: LocalCosts, b: LocalCosts) -> LocalCosts:
    """The mean of two calibrations (:class:`LocalCosts`), term by term: calibrating before and
    after the runs brackets a machine whose speed drifts by tens of percent within minutes."""
    from dataclasses import fields, replace

    from rhymerl.scheduling import StepCost

    def mean(x: Any, y: Any) -> Any:
        if isinstance(x, StepCost):
            return StepCost(x.batch, tuple((u + v) / 2 for u, v in zip(x.seconds, y.seconds)),
                            (x.prefill_per_token_s + y.prefill_per_token_s) / 2, x.name)
        if isinstance(x, dict):
            return {k: mean(x[k], y[k]) for k in x.keys() & y.keys()}
        if isinstance(x, tuple):
            return tuple(mean(u, v) for u, v in zip(x, y))
        if isinstance(x, float):
            return (x + y) / 2
        return x  # counts (cores, threads) are the same in both

    return replace(a, **{f.name: mean(getattr(a, f.name), getattr(b, f.name)) for f in fields(a)})


def describe(c: LocalCosts) -> str:
    """One line of a calibration's main terms."""
    return (f"trainer {1e6 * c.train_s_per_token:.1f} us/token; engine at 128 {1e3 * c.engine.step_s(128):.2f} ms; "
            f"history drafter {1e6 * c.history_draft_s_per_row:.1f} us/row; side by side: engine beside engine "
            f"x{c.engine_pair_slowdown:.2f}; the trainer on the cores the worker leaves x{c.rest_alone:.2f} alone, beside it "
            f"x{c.beside_rest[0]:.2f}, x{c.beside_rest[1]:.2f}")


def calibrate(model: str, cfg: RunConfig) -> LocalCosts:
    """This machine's :class:`LocalCosts` for runs of ``cfg``'s shape on ``model`` (the trainer on
    the base model's own responses to held-out prompts, which the runs never train on). Each
    cost is a median, a typical step rather than the best one."""
    import torch

    from rhymerl.data.splits import task_splits
    from rhymerl.device import torch_threads
    from rhymerl.distribution.factory import profile_engine, trainer_threads_beside_workers, worker_specs
    from rhymerl.engine import SamplingParams
    from rhymerl.llm import LLM
    from rhymerl.model import load_pretrained
    from rhymerl.bench.step_model import LocalCosts
    from rhymerl.tokenizer import encode_prompt, load_tokenizer
    from rhymerl.training.update.trainer import Experience, PolicyTrainer

    r = cfg.rollout
    tok = load_tokenizer(model)
    held_out = task_splits(cfg.data, cfg.seed)[1][: cfg.trainer.batch_prompts]
    prompts = [encode_prompt(tok, row.prompt) for row in held_out]
    outs = LLM(model, max_num_seqs=r.max_num_seqs, max_model_len=r.max_model_len).generate(
        prompts, SamplingParams(n=r.n, temperature=r.temperature, max_tokens=r.max_tokens, seed=7), use_tqdm=False)
    pairs = [(o.prompt_token_ids, c.token_ids) for o in outs for c in o.outputs]
    exp = Experience.build([p for p, _ in pairs], [c for _, c in pairs],
                           list(np.random.default_rng(0).normal(size=len(pairs))), tok.pad_token_id or 0)
    tokens = float(sum(len(p) + len(c) for p, c in pairs))
    policy = load_pretrained(model)
    trainer = PolicyTrainer(policy, cfg.trainer, cfg.algorithm, torch.device("cpu"),
                            total_optimizer_steps=100, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
    batches = (1, 8, 32, 64, 128, 256)
    engine = profile_engine(model, batches=batches, name="engine, this process", typical=True)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine_1t = profile_engine(model, batches=batches, name="engine, one thread", typical=True)
    finally:
        torch.set_num_threads(before)
    logp_s = [0.0]

    def train_once() -> float:
        t = time.perf_counter()
        trainer.compute_logps(exp)
        logp_s[0] = time.perf_counter() - t
        trainer.update(exp, step=1, seed=0)
        return time.perf_counter() - t

    train_once()
    # the median of three: a run's typical step, not its best
    alone_t, logp_t = sorted((train_once(), logp_s[0]) for _ in range(3))[1]
    cores = os.cpu_count() or 1
    rollout_rows = cfg.trainer.batch_prompts * r.n
    pair = engine_beside_engine(model, max(1, rollout_rows // 2))
    # a lone worker beside the trainer (async RL, a streamed update) and the trainer's share: the
    # factory's rule, as the runs get it
    overlapped = copy.deepcopy(cfg)
    overlapped.trainer.stream_update = True
    threads = worker_specs(overlapped, model)[0].threads
    rest_threads = trainer_threads_beside_workers(overlapped)

    def train_on_the_rest() -> float:  # a streamed update's helper, async RL's update
        with torch_threads(rest_threads):
            return train_once()

    rest_alone = float(np.median([train_on_the_rest() for _ in range(3)])) / alone_t
    rest = engine_beside_trainer(model, threads, rollout_rows, train_on_the_rest, alone_t)
    draft = history_draft_s_per_row(model, prompts, r)
    return LocalCosts(engine, engine_1t, alone_t / tokens, cores, torch.get_num_threads(),
                      logp_share=logp_t / alone_t, engine_pair_slowdown=pair,
                      history_draft_s_per_row=draft, beside_rest=rest, rest_alone=rest_alone)
