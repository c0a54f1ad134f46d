#!/usr/bin/env bash
# Engine speed, tracing, plain vLLM and tbik's matmul on two GPUs of one host, side by side:
#   GPU 0: graph replays against eager steps (bitwise, every kernel mode); the engine on vLLM's
#          workload (256 random prompts of 64-512 tokens, 128 new tokens, generate at batch 32);
#          the engine on the default suite; then tbik's GPU tests, tile sweep and matmul bench
#          (median of 3 runs, written to reports/perf/tbik_matmul.json's shape).
#   GPU 1: plain vLLM on the same workload, with its own batching and capped at 32 sequences
#          (the engine's batch), then the tracing overhead (benchmarks/trace_bench.py, batch 8).
#
#   OUT=dir [ENGINE_KERNELS=stock,bi,tbik] bash benchmarks/gpu_lanes.sh   # .carry/vllm/part-1.tar.xz carried
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-reports/perf/lanes}
KERNELS=${ENGINE_KERNELS:-stock,bi,tbik}
source benchmarks/gpu_vllm_setup.sh
lane0() {
  export CUDA_VISIBLE_DEVICES=0
  graph_tests
  step "engine speed, vLLM's workload, generate batch 32"
  timeout "${RANDOM_BUDGET:-120}" "${speed[@]}" --kernels "$KERNELS" --mode generate --batch 32 --chunks 8 --random 256 \
    --new 128 --json "$OUT/engine_speed_random.json" 2>&1 | grep -v Loading
  step "engine speed, default suite"
  timeout "${SPEED_BUDGET:-150}" "${speed[@]}" --kernels "$KERNELS" --batch 1,8,32 --chunks 2 --new 64 \
    --json "$OUT/engine_speed.json" 2>&1 | grep -v Loading
  step "tbik: GPU tests, sweep, bench x3"
  OUT="$OUT/kernels" timeout "${KERNEL_BUDGET:-330}" bash benchmarks/gpu_kernels.sh tests sweep
  timeout 200 python3 benchmarks/kernels.py bench --repeat 3 --out "$OUT/kernels" --json "$OUT/tbik_matmul.json" \
    > "$OUT/kernels/bench.log" 2>&1; echo "exit $?" >> "$OUT/kernels/bench.log"; grep "geometric" "$OUT/kernels/bench.log"
  step "lane 0 done"
}

lane1() {
  export CUDA_VISIBLE_DEVICES=1
  step "plain vLLM, vLLM's workload: own batching, then at most 32 sequences"
  for args in '{}' '{"max_num_seqs": 32}'; do
    timeout 200 python3 benchmarks/vllm_speed.py --model "$MODEL" --tp 1 --kernels stock --prompts 256 --new 128 --runs 1 \
      --vllm-args "$args" --json "$OUT/vllm_speed.json" 2>&1 | grep -v "it/s\]" | tail -n 3
  done
  trace_overhead 2 "${TRACE_BUDGET:-200}"
  step "lane 1 done"
}

run_lanes
tail -n 30 "$OUT/lane0.log" "$OUT/lane1.log"
