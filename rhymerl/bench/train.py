"""``rhymerl bench train``: the policy update on 1 and 2 trainer ranks, FSDP2 and DDP, on the same batch.

Per row: the update's wall time (median of 5 on the same batch), the ranks' peak resident
memory, the bytes of parameters, gradients and optimizer state one rank holds, the relative
difference of the full gradient from one plain process's on the same batch, and one weight
publication (rank 0 gathers the policy and writes it into the controller's copy).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rhymerl.bench.common import print_table, write_report


def synthetic_batch(vocab: int, *, sequences: int = 64, seed: int = 0) -> Any:
    """An RL batch shaped like the main job's: prompts of 12-40 tokens, responses of 4-120, random advantages."""
    from rhymerl.training.update.trainer import Experience

    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(sequences):
        p = int(torch.randint(12, 41, (1,), generator=g))
        r = int(torch.randint(4, 121, (1,), generator=g))
        prompts.append(torch.randint(3, vocab, (p,), generator=g).tolist())
        responses.append(torch.randint(3, vocab, (r,), generator=g).tolist())
    adv = torch.randn(sequences, generator=g).tolist()
    return Experience.build(prompts, responses, adv, pad_id=0)


def bench_model(folder: Path, *, vocab: int = 512, seed: int = 0) -> Path:
    """A random policy of the main job's shape (rhymerl.config.ModelSection), saved as an HF folder."""
    from rhymerl.config import ModelSection
    from rhymerl.model import CausalLM, ModelConfig, save_pretrained

    m = ModelSection()
    cfg = ModelConfig(vocab_size=vocab, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                      num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
                      num_key_value_heads=m.num_key_value_heads, eos_token_id=2)
    model = CausalLM(cfg)
    model.init_weights(seed)
    save_pretrained(model, folder)
    return folder


def reference_gradient(model_path: Path, exp: Any, overrides: list[str]) -> dict[str, torch.Tensor]:
    """One plain process's gradient of the whole batch taken as one mini-batch."""
    from rhymerl.config import load_config
    from rhymerl.model import load_pretrained
    from rhymerl.training.update.trainer import PolicyTrainer

    cfg = load_config(None, overrides)
    model = load_pretrained(model_path)
    r = cfg.rollout
    tr = PolicyTrainer(model, cfg.trainer, cfg.algorithm, torch.device("cpu"), temperature=r.temperature,
                       top_p=r.top_p, top_k=r.top_k)
    model.train()
    tr.accumulate_gradient(exp, torch.arange(exp.input_ids.shape[0]))
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def grad_rel_diff(a: dict[str, Any], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over every parameter's gradient."""
    num = sum(float((torch.as_tensor(a[n]) - g).pow(2).sum()) for n, g in b.items())
    den = sum(float(g.pow(2).sum()) for g in b.values())
    return (num / max(den, 1e-30)) ** 0.5


def measure(model_path: Path, exp: Any, world_size: int, strategy: str, overrides: list[str],
            reference: dict[str, torch.Tensor], repeats: int = 5, backend: str = "local") -> dict[str, Any]:
    """One row: a trainer group of ``world_size`` ranks on ``exp``."""
    from rhymerl.config import load_config
    from rhymerl.training.update.trainer_group import TrainerGroup
    from rhymerl.model import load_pretrained

    cfg = load_config(None, overrides + [f"trainer.world_size={world_size}", f"trainer.strategy={strategy}",
                                         f"rollout.backend={backend}"])
    controller = load_pretrained(model_path)
    group = TrainerGroup(cfg, model_path, controller, with_ref=False, total_optimizer_steps=repeats + 1)
    try:
        grad = group.gradient(exp)  # before any step: the same weights as the reference
        diff = grad_rel_diff(grad, reference)
        group.compute_logps(exp)
        times = []
        for i in range(repeats):
            t = time.perf_counter()
            group.update(exp, step=i + 1, seed=0)
            times.append(time.perf_counter() - t)
        mem = group.memory()
        sync = group.publish()
    finally:
        group.close()
    return {"world_size": world_size, "strategy": strategy, "backend": backend,
            "update_s": statistics.median(times), "peak_mem_mb": max(m["peak_rss_bytes"] for m in mem) / 2**20,
            "param_state_bytes_per_rank": max(m["param_state_bytes"] for m in mem),
            "grad_rel_diff_vs_1": diff, "sync_s": sync.seconds, "sync_bytes": sync.bytes}


def run(json_path: str | None = None, *, quick: bool = False, backend: str = "local") -> dict[str, Any]:
    repeats = 2 if quick else 5
    overrides = ["trainer.micro_batch_tokens=1536", "trainer.ppo_mini_batches=2"]
    with tempfile.TemporaryDirectory() as tmp:
        model_path = bench_model(Path(tmp) / "policy")
        exp = synthetic_batch(512, sequences=32 if quick else 64)
        reference = reference_gradient(model_path, exp, overrides)
        rows = []
        for strategy in ("fsdp", "ddp"):
            for world in (1, 2):
                rows.append(measure(model_path, exp, world, strategy, overrides, reference, repeats, backend))
                print(f"  {strategy} x{world}: update {rows[-1]['update_s']:.3f}s", flush=True)
    for r in rows:
        one = next(x for x in rows if x["strategy"] == r["strategy"] and x["world_size"] == 1)
        r["state_vs_1"] = r["param_state_bytes_per_rank"] / one["param_state_bytes_per_rank"]
        r["update_speedup_vs_1"] = one["update_s"] / r["update_s"]
    print_table(rows, ["world_size", "strategy", "update_s", "update_speedup_vs_1", "peak_mem_mb",
                       "param_state_bytes_per_rank", "state_vs_1", "grad_rel_diff_vs_1", "sync_s"])
    return write_report(rows, json_path, {"batch_sequences": int(exp.input_ids.shape[0]),
                                          "batch_tokens": int(exp.response_mask.sum()), "repeats": repeats})
