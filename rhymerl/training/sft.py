"""Supervised fine-tuning from scratch on a built-in task's worked solutions.

Gives RL a base policy that is right sometimes: a tiny model of our architecture, trained
for a few minutes on the CPU, written as an ordinary HF folder (weights, config, tokenizer)
with a ``rhymerl_card.json`` saying how it was made.
"""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from rhymerl.config import RunConfig, SFTSection
from rhymerl.data.splits import task_splits
from rhymerl.device import resolve_device
from rhymerl.llm import LLM
from rhymerl.atomic_io import atomic_write_text
from rhymerl.model import CausalLM, ModelConfig, save_pretrained
from rhymerl.progress import progress as progress_bar
from rhymerl.rewards import RewardRegistry
from rhymerl.tasks import Task, get_task
from rhymerl.tokenizer import build_char_tokenizer
from rhymerl.training.metrics.heldout import evaluate

CARD = "rhymerl_card.json"


def sft_output_dir(cfg: RunConfig) -> Path:
    return Path(cfg.sft.output_dir.format(task=cfg.data.task, seed=cfg.seed))


# A draft model for the built-in tasks (``rhymerl sft --draft``): one narrow layer, the same
# character tokenizer, trained on the same worked solutions as the base it drafts for.
DRAFT_MODEL = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1)


def draft_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the draft model's architecture and its own output folder."""
    import copy

    d = copy.deepcopy(cfg)
    for k, v in DRAFT_MODEL.items():
        setattr(d.model, k, v)
    d.sft.output_dir = cfg.sft.output_dir + "-draft"
    return d


def short_base(card: dict) -> str | None:
    """Why a base cut short by ``sft.max_minutes`` is a worse start for RL, or None for a whole one."""
    done = card.get("steps")
    planned = card.get("config", {}).get("sft", {}).get("steps", done)
    if done is None or planned is None or done >= planned:
        return None
    return (f"the base trained {card['steps']} of its {planned} SFT steps (sft.max_minutes cut it); a short base "
            f"starts RL lower and may not learn at all. Unset sft.max_minutes and delete the base to train it whole")


def read_card(base: Path) -> dict | None:
    """The card of a base ``rhymerl sft`` made (None for any other model folder)."""
    path = Path(base) / CARD
    return json.loads(path.read_text()) if path.exists() else None


def print_card(card: dict, out: Path) -> None:
    ls = card["response_length"]
    print(f"base model: {out}  ({card['params'] / 1e6:.2f}M params, {card['steps']} steps, "
          f"{card['train_seconds']:.0f}s)")
    print(f"held-out greedy accuracy: {100 * card['heldout_greedy_accuracy']:.1f}% on "
          f"{card['heldout_prompts']} prompts; response length min/median/max "
          f"{ls['min']}/{ls['median']:.0f}/{ls['max']}")
    share = card["config"]["sft"].get("unanswered_share", 0.0)
    if share:
        print(f"(its SFT examples left the final answer line out {100 * share:.0f}% of the time, so it rarely "
              f"gives one: RL has to learn to)")
    short = short_base(card)
    if short:
        print(f"base model: WARNING: {short}")


def lr_at(step: int, total: int, warmup: int, base: float) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def _length_bucketed_batches(examples: list[tuple[list[int], int]], bs: int,
                             rng: random.Random) -> list[list[int]]:
    """One epoch of batches of similar length: shuffled, sorted within windows of 16 batches."""
    idx = rng.sample(range(len(examples)), len(examples))
    batches = []
    for w in range(0, len(idx), bs * 16):
        window = sorted(idx[w: w + bs * 16], key=lambda i: len(examples[i][0]))
        batches += [window[j: j + bs] for j in range(0, len(window) - bs + 1, bs)]
    rng.shuffle(batches)
    return batches


def sft_examples(task: Task, sft: SFTSection, rng: random.Random, mix: random.Random,
                 exclude: set[str]) -> list[tuple[str, str]]:
    """(prompt, response) pairs: worked solutions of problems drawn with ``rng`` and not in
    ``exclude`` (the held-out prompts), a share ``sft.unanswered_share`` of them (drawn with
    ``mix``, so the problems do not depend on the share) without their final answer line."""
    out: list[tuple[str, str]] = []
    while len(out) < sft.num_examples:
        p = task.make_problem(rng)
        if p.prompt in exclude:
            continue
        unanswered = sft.unanswered_share > 0 and mix.random() < sft.unanswered_share
        out.append((p.prompt, task.unanswered_solution(p) if unanswered else p.solution))
    return out


def _new_model(cfg: RunConfig, tok: Any) -> CausalLM:
    """The base's architecture from ``model.*``, its weights drawn from the seed."""
    m = cfg.model
    mcfg = ModelConfig(model_type=m.model_type, vocab_size=len(tok), hidden_size=m.hidden_size,
                       intermediate_size=m.intermediate_size, num_hidden_layers=m.num_hidden_layers,
                       num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
                       max_position_embeddings=cfg.rollout.max_model_len, tie_word_embeddings=True,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, qk_norm=m.model_type == "qwen3",
                       attention_bias=m.model_type == "qwen2")
    torch.manual_seed(cfg.seed)
    model = CausalLM(mcfg)
    model.init_weights(cfg.seed)
    return model


def _encoded(pairs: list[tuple[str, str]], tok: Any) -> list[tuple[list[int], int]]:
    """Each (prompt, response) as (prompt + response + EOS, prompt length)."""
    examples = []
    for prompt, response in pairs:
        ids = tok.encode(prompt, add_special_tokens=False)
        examples.append((ids + tok.encode(response, add_special_tokens=False) + [tok.eos_token_id], len(ids)))
    return examples


def _batch(batch: list[tuple[list[int], int]], bs: int, pad_id: int,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded ids and targets: the response's tokens, the prompt's masked (-100)."""
    T = max(len(x) for x, _ in batch)
    ids = torch.full((bs, T), pad_id, dtype=torch.long)
    tgt = torch.full((bs, T), -100, dtype=torch.long)
    for i, (x, plen) in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        tgt[i, plen - 1: len(x) - 1] = torch.tensor(x[plen:])  # predict the response only
    return ids.to(device), tgt.to(device)


def _sft_step(model: CausalLM, opt: torch.optim.Optimizer, ids: torch.Tensor, tgt: torch.Tensor, lr: float) -> float:
    """One next-token step on a batch (targets -100 where the loss does not count); its loss."""
    for g in opt.param_groups:
        g["lr"] = lr
    loss = F.cross_entropy(model(ids).flatten(0, 1).float(), tgt.flatten(), ignore_index=-100)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def run_sft(cfg: RunConfig, out_dir: str | Path | None = None, *, progress: bool = True,
            clock: Callable[[], float] = time.monotonic) -> dict:
    """Train the base model and write it to ``out_dir``; returns the card. ``clock`` is read only
    for the opt-in ``sft.max_minutes`` and the card's seconds (a test's fake clock)."""
    t_start = clock()
    out = Path(out_dir) if out_dir is not None else sft_output_dir(cfg)
    task = get_task(cfg.data.task)
    if task.chat:
        raise ValueError(f"task {task.name!r} is a chat task: it trains a pretrained model (model.path), "
                         f"not a base from scratch")
    tok = build_char_tokenizer(task.alphabet)
    model = _new_model(cfg, tok)
    device = resolve_device(cfg.model.device)
    model.to(device).train()

    _, val = task_splits(cfg.data, cfg.seed)
    rng = random.Random(cfg.seed)  # the problems, then the batch order
    pairs = sft_examples(task, cfg.sft, rng, random.Random(cfg.seed + 1), exclude={str(r.prompt) for r in val})
    examples = _encoded(pairs, tok)

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft.lr, weight_decay=cfg.sft.weight_decay,
                            betas=(0.9, 0.98))
    steps, bs = cfg.sft.steps, cfg.sft.batch_size
    order: list[list[int]] = []
    bar = progress_bar(range(steps), desc="sft", total=steps, enabled=progress)
    loss_ema, done_steps, stopped_early = None, 0, False
    for step in bar:
        if cfg.sft.max_minutes is not None and clock() - t_start > cfg.sft.max_minutes * 60:
            stopped_early = True
            break
        if not order:
            order = _length_bucketed_batches(examples, bs, rng)
        ids, tgt = _batch([examples[i] for i in order.pop()], bs, tok.pad_token_id, device)
        loss = _sft_step(model, opt, ids, tgt, lr_at(step, steps, cfg.sft.warmup_steps, cfg.sft.lr))
        done_steps = step + 1
        loss_ema = loss if loss_ema is None else 0.95 * loss_ema + 0.05 * loss
        bar.set_postfix(loss=f"{loss_ema:.3f}")
    bar.close()
    train_s = clock() - t_start

    model.eval()
    llm = LLM(model, tokenizer=tok, max_num_seqs=256, max_model_len=cfg.rollout.max_model_len, device=str(device))
    ev = evaluate(llm, val[: cfg.sft.eval_prompts], RewardRegistry(), max_tokens=cfg.rollout.max_tokens)
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, out)
    tok.save_pretrained(str(out))
    card = {
        "made_by": "rhymerl sft", "task": cfg.data.task, "seed": cfg.seed,
        "params": sum(p.numel() for p in model.parameters()),
        "config": {"sft": vars(cfg.sft), "model": vars(cfg.model)},
        "steps": done_steps, "stopped_early_for_time": stopped_early, "final_loss": loss_ema,
        "train_seconds": round(train_s, 1), "heldout_greedy_accuracy": ev.accuracy,
        "heldout_prompts": len(ev.lengths), "response_length": ev.length_stats(), "format_ok": ev.format_ok,
    }
    atomic_write_text(out / CARD, json.dumps(card, indent=2) + "\n")  # last: the card marks a finished base
    return card


# What a card written before a setting existed was trained with.
_BEFORE_THE_KEY = {"sft.unanswered_share": 0.0}
_NOT_COMPARED = {"sft.output_dir", "sft.max_minutes", "model.path", "model.device", "model.dtype"}


def stale_keys(card: dict, cfg: RunConfig) -> list[str]:
    """``section.key: was -> now`` for each SFT or model setting the card's base was trained with
    that the config now sets otherwise (where it is written, and on what, aside)."""
    out = []
    for section, now in (("sft", vars(cfg.sft)), ("model", vars(cfg.model))):
        was = card.get("config", {}).get(section, {})
        for k, v in now.items():
            key = f"{section}.{k}"
            old = was.get(k, _BEFORE_THE_KEY.get(key, v))
            if key not in _NOT_COMPARED and old != v:
                out.append(f"{key}: {old} -> {v}")
    return out


def ensure_base_model(cfg: RunConfig) -> Path:
    """The policy to start from: ``model.path`` (an HF folder, a GGUF file or a named model such
    as ``smollm2``: :mod:`rhymerl.model.gguf`), or the task's SFT base (trained if missing)."""
    if cfg.model.path:
        from rhymerl.model.gguf import resolve_model

        return resolve_model(cfg.model.path)
    out = sft_output_dir(cfg)
    card_path = out / CARD
    if card_path.exists():
        card = json.loads(card_path.read_text())
        print(f"base model: reusing {out} (held-out greedy accuracy "
              f"{100 * card['heldout_greedy_accuracy']:.1f}%)")
        if short_base(card):
            print(f"base model: WARNING: {short_base(card)}")
        changed = stale_keys(card, cfg)
        if changed:
            print(f"base model: warning: {out} was trained with other settings ({', '.join(changed)}); "
                  f"delete it, or set sft.output_dir, to train one with these")
        return out
    print(f"base model: none at {out}; training it from scratch (rhymerl sft)")
    print_card(run_sft(cfg, out), out)
    return out


def ensure_draft_model(cfg: RunConfig) -> Path:
    """The task's small draft model (``rhymerl sft --draft``), trained if missing."""
    d = draft_config(cfg)
    d.model.path = None
    return ensure_base_model(d)
