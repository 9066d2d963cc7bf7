#!/usr/bin/env bash
# HistoSpec on SmolLM2-135M-Instruct (the chat_sums task's prompts), by sequences in flight and
# temperature: `rhymerl bench spec` per cell, plain decoding timed in turn in every round.
#   scripts/bench_smollm2.sh [native|vllm] [OUT_DIR]     (needs pip install -e ".[gguf]")
# Env: IN_FLIGHT="1 4 16 64", SAMPLING="1.0:1.0 0.7:0.9" (temperature:top-p), ROUNDS=5, METHODS=...,
# MODEL=smollm2 (or a policy folder: an RL run's checkpoints/step_N/policy), EPOCHS=1,2,3,
# MAX_TOKENS=48 (the rollout's tail, lengths that vary: IN_FLIGHT=64 MAX_TOKENS=200).
# Each cell writes OUT_DIR/ENGINE-T<temperature>-b<in flight>-m<max tokens>.json; docs/results.md has the tables.
set -euo pipefail
engine=${1:-native}
out=${2:-bench-smollm2}
rounds=${ROUNDS:-5}
mkdir -p "$out"
# in flight -> prompts x samples: at least as many sequences as are in flight
declare -A prompts=([1]=1 [4]=1 [16]=4 [64]=16)
for tp in ${SAMPLING:-1.0:1.0 0.7:0.9}; do  # temperature:top-p
  IFS=: read -r temp top_p <<<"$tp"
  for b in ${IN_FLIGHT:-1 4 16 64}; do
    common=(--model "${MODEL:-smollm2}" --task chat_sums --prompts "${prompts[$b]}" --n 4 --max-tokens "${MAX_TOKENS:-48}"
            --max-num-seqs "$b" --temperatures "$temp" --top-p "$top_p" --epochs "${EPOCHS:-1,2,3}" --reps "$rounds"
            --json "$out/$engine-T$temp-b$b-m${MAX_TOKENS:-48}.json")
    if [ "$engine" = vllm ]; then
      rhymerl bench spec --engine vllm --methods "${METHODS:-ngram,suffix,history}" "${common[@]}"
    else
      rhymerl bench spec --gate on --methods "${METHODS:-none,ngram,suffix_global,histospec_path}" "${common[@]}"
    fi
  done
done
