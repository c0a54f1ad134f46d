#!/usr/bin/env bash
# Two GPUs: vLLM stock and tbik at TP=2 side by side in one call (benchmarks/vllm_speed.py, 256
# random prompts of 64-512 tokens, 128 new, median of RUNS=7), then vLLM at TP=2 (tbik, generate,
# batch 1 and 32, vLLM's defaults) against the committed trainer cell (the transformers engine at
# TP=1, reports/vllm/h200x2-trainer-rollout/).
#
#   OUT=dir bash benchmarks/gpu_vllm_speed_tp2.sh      # .carry/vllm/part-1.tar.xz carried
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_vllm_setup.sh
step "vLLM stock,tbik TP=2: speed"
speed_tp2 "${RUNS:-7}"
step "rollout: vLLM TP=2 batch 1, 32, tbik, against the committed trainer cell"
committed_trainer /tmp/trainer
rollout_tp2 /tmp/r/vllm --model builtin:qwen3-0.6b
trainer_rollout_diffs /tmp/trainer /tmp/r/vllm
step done
