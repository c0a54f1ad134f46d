#!/usr/bin/env bash
# The transformers engine and plain vLLM on two GPUs of one host, side by side in one call:
#   GPU 0: graph replays against eager steps (bitwise, every kernel mode), then
#          benchmarks/engine_speed.py on the default suite (stock, bi, tbik; batch 1, 8, 32;
#          score and generate) and on vLLM's workload (benchmarks/vllm_speed.py's 256 random
#          prompts of 64-512 tokens, 128 new tokens, generate at batch 32, with a profile);
#   GPU 1: plain vLLM on that same workload (benchmarks/vllm_speed.py, TP=1, stock), the vLLM
#          GPU tests, then the tracing overhead (benchmarks/trace_bench.py, batch 8).
#
#   OUT=dir bash benchmarks/gpu_engine_vs_vllm.sh      # with .carry/vllm/part-1.tar.xz carried
#
# Writes to $OUT: machine.txt, lane0.log, lane1.log, pytest-*.log, engine_speed*.json,
# vllm_speed.json, trace_overhead.json, profiles/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-reports/perf/lanes}
source benchmarks/gpu_vllm_setup.sh
lane0() {
  export CUDA_VISIBLE_DEVICES=0
  graph_tests
  step "engine speed, vLLM's workload, generate batch 32"
  timeout "${RANDOM_BUDGET:-150}" "${speed[@]}" --kernels stock,bi,tbik --mode generate --batch 32 --chunks 8 --random 256 \
    --new 128 --profile "$OUT/profiles" --json "$OUT/engine_speed_random.json" 2>&1 | grep -v Loading
  step "engine speed, default suite"
  timeout "${SPEED_BUDGET:-330}" "${speed[@]}" --kernels stock,bi,tbik --batch 1,8,32 --chunks 2 --new 64 \
    --json "$OUT/engine_speed.json" 2>&1 | grep -v Loading
  step "lane 0 done"
}

lane1() {
  export CUDA_VISIBLE_DEVICES=1
  step "plain vLLM, vLLM's workload"
  timeout 200 python3 benchmarks/vllm_speed.py --model "$MODEL" --tp 1 --kernels stock --prompts 256 --new 128 --runs 1 \
    --json "$OUT/vllm_speed.json" 2>&1 | grep -v "it/s\]" | tail -n 4
  step "pytest: vLLM on the GPU"
  REPAUDIT_VLLM_MODEL="$MODEL" timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs -m gpu \
    tests/test_vllm_engine.py > "$OUT/pytest-vllm.log" 2>&1; echo "exit $?" >> "$OUT/pytest-vllm.log"
  tail -n 3 "$OUT/pytest-vllm.log"
  trace_overhead 1 "${TRACE_BUDGET:-150}"
  step "lane 1 done"
}

run_lanes
