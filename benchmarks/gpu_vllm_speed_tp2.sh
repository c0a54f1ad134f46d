#!/usr/bin/env bash
# Two GPUs: vLLM stock and tbik at TP=2 side by side in one call (benchmarks/vllm_speed.py, 256
# random prompts of 64-512 tokens, 128 new, median of RUNS=7), then vLLM at TP=2 (tbik, generate,
# batch 1 and 32, vLLM's defaults) against the committed trainer cell (the transformers engine at
# TP=1, reports/vllm/h200x2-trainer-rollout/).
#
#   OUT=dir bash benchmarks/gpu_vllm_speed_tp2.sh      # .carry/vllm/part-1.tar.xz carried
#
# INTERLEAVE=1 loads both modes at once for the speed step; VLLM_ARGS=FILE (a JSON object of
# engine arguments) goes to both the speed step and the rollout, so the rollout's bits are shown
# under the same arguments as the speed.
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_vllm_setup.sh
step "vLLM stock,tbik TP=2: speed"
speed_tp2 "${RUNS:-7}"
step "rollout: vLLM TP=2 batch 1, 32, tbik, against the committed trainer cell"
committed_trainer /tmp/trainer
mapfile -t extra < <(python3 -c 'import json, sys
for k, v in json.load(open(sys.argv[1])).items():
    print("--vllm-arg"); print(f"{k}={json.dumps(v)}")' "${VLLM_ARGS:-/dev/null}" 2>/dev/null)
rollout_tp2 /tmp/r/vllm --model builtin:qwen3-0.6b "${extra[@]}"
trainer_rollout_diffs /tmp/trainer /tmp/r/vllm
step done
