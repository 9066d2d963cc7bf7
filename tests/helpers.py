"""Shared test helpers (no fixtures: those are conftest.py's): tiny random models built
in-process (no downloads), the tiny RL run's overrides, what a run learnt, a killed-and-resumed run."""
from __future__ import annotations

from pathlib import Path

import torch

from rhymerl.model import CausalLM, ModelConfig
from rhymerl.training.metrics.logger import read_metrics


def tiny_config(**kw) -> ModelConfig:
    base = dict(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, eos_token_id=2)
    base.update(kw)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, std: float = 0.3, **kw) -> CausalLM:
    """Random weights with a large std so that distributions are far from uniform
    (greedy decoding then has few near-ties)."""
    m = CausalLM(tiny_config(**kw))
    m.init_weights(seed, std=std)
    return m.eval()


def naive_greedy(model: CausalLM, prompt: list[int], n: int) -> list[int]:
    """Reference decoding: recompute the whole sequence every token, no cache."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


# --- tiny RL runs (shared by the RL, hardening and fault tests) ---------------------------
TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_attention_heads=2",
        "model.num_key_value_heads=1", "sft.steps=60", "sft.batch_size=16", "sft.num_examples=500",
        "sft.eval_prompts=8", "data.num_val=8", "data.num_train=6", "trainer.batch_prompts=4", "rollout.n=2",
        "rollout.max_tokens=24", "rollout.max_model_len=48", "trainer.steps=4", "trainer.save_every=1",
        "trainer.eval_every=2", "trainer.micro_batch_size=4", "trainer.lr=1e-3",
        "rollout.speculative.index_draft_tokens=4",
        "algorithm.kl_coef=0.05", "trainer.ppo_mini_batches=1",  # a reference model to checkpoint and resume
        "algorithm.dynamic_sampling=false",  # 2 samples per group: the default filter would drop most groups
        # The tiny base rarely earns a reward, so every group's advantage is 0: an entropy term
        # makes every step move the weights, or a resume that restored nothing would still pass.
        "algorithm.entropy_coef=0.01"]
# The tiny model with a head size vLLM's CPU attention runs (32; TINY's is 16).
VLLM_TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=2",
             "model.num_key_value_heads=1"]
SPEED_KEYS = ("timing_s/", "perf/", "spec/", "pipe/", "draft/accept_rate")  # how fast, not what is learnt


def rl_overrides(base: str, run_dir: Path) -> list[str]:
    return TINY + [f"model.path={base}", f"trainer.output_dir={run_dir}"]


def learning_metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(SPEED_KEYS)} for r in read_metrics(run_dir / "metrics.jsonl")]


def kill_and_resume(run_dir: Path, overrides: list[str], *, after_step: int = 2, last_step: int | None = None) -> None:
    """`rhymerl train` with ``overrides``, SIGKILLed (with every process it started) once the
    checkpoint of ``after_step`` exists, then `--resume` to the end. ``last_step``: assert the
    kill landed before that step's checkpoint."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from rhymerl.training.checkpoint import latest_checkpoint

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rhymerl.cli", "train", *overrides], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        ck = latest_checkpoint(run_dir)
        if ck is not None and ck.name >= f"step_{after_step:06d}":
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if last_step is not None:
        assert latest_checkpoint(run_dir).name < f"step_{last_step:06d}"
    subprocess.run([sys.executable, "-m", "rhymerl.cli", "train", "--resume", str(run_dir)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def tokens_of(outs) -> list[list[list[int]]]:
    """Each request's samples' tokens (``LLM.generate``'s outputs)."""
    return [[c.token_ids for c in o.outputs] for o in outs]


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_chat_model(folder: Path, alphabet: str) -> Path:
    """A random tiny Qwen2 (tied embeddings, biases) whose character tokenizer has a chat template."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rhymerl.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(alphabet)
    tok.chat_template = CHAT_TEMPLATE
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tok.save_pretrained(str(folder))
    return folder
