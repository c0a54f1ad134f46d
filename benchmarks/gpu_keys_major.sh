#!/usr/bin/env bash
# tbik's paged attention keys-major in vLLM's decode steps, two GPUs: its GPU tests, vLLM at TP=2
# (batch 1 and 32, tbik, generate, vLLM's defaults) against the committed trainer cell (the
# transformers engine at TP=1, reports/vllm/h200x2-trainer-rollout/), the kernel against the
# row-major one in CUDA graphs, then stock and tbik generation side by side (vllm_speed.py).
#   OUT=dir [RUNS=2] bash benchmarks/gpu_keys_major.sh      # .carry/vllm/part-1.tar.xz carried
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_vllm_setup.sh
step "GPU tests: the paged kernel keys-major against row-major, paged against dense"
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_tbik_gpu.py -k "paged" \
  > "$OUT/pytest.log" 2>&1; echo "exit $?" >> "$OUT/pytest.log"; tail -n 2 "$OUT/pytest.log"
step "rollout: vLLM TP=2 batch 1, 32, tbik, against the committed trainer cell"
committed_trainer /tmp/trainer
rollout_tp2 /tmp/r/vllm --model builtin:qwen3-0.6b
trainer_rollout_diffs /tmp/trainer /tmp/r/vllm
step "paged attention: keys-major against row-major"
timeout 60 python3 benchmarks/paged_attention_bench.py --json "$OUT/paged_attention.json"
step "speed: stock and tbik, TP=2"
SPEED_BUDGET=${SPEED_BUDGET:-240} speed_tp2 "${RUNS:-2}"
step done
