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
OUT=${OUT:-reports/perf/lanes}; mkdir -p "$OUT"
KERNELS=${ENGINE_KERNELS:-stock,bi,tbik}
START=$(date +%s)
step() { echo "== $(date +%T) [$(( $(date +%s) - START ))s] $1"; }
nvidia-smi -L > "$OUT/machine.txt"
bash benchmarks/vllm_install.sh 1 > "$OUT/vllm_install.log" 2>&1
source benchmarks/vllm_env.sh
python3 -c 'import torch, triton, transformers, vllm; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__, "vllm", vllm.__version__)' >> "$OUT/machine.txt" 2>&1
MODEL=$(python3 -c 'from repaudit import builtin; print(builtin.ensure("builtin:qwen3-0.6b"))')
speed=(python3 benchmarks/engine_speed.py --model builtin:qwen3-0.6b --runs 1)

lane0() {
  export CUDA_VISIBLE_DEVICES=0
  step "pytest: graph replays vs eager steps"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_hf_decode.py -k graph \
    > "$OUT/pytest-decode.log" 2>&1; echo "exit $?" >> "$OUT/pytest-decode.log"; tail -n 2 "$OUT/pytest-decode.log"
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
  step "tracing overhead, batch 8"
  timeout "${TRACE_BUDGET:-200}" python3 benchmarks/trace_bench.py --model builtin:qwen3-0.6b --probes default --batch-size 8 \
    --repeats 2 --json "$OUT/trace_overhead.json" 2>&1 | grep -v Loading
  step "lane 1 done"
}

lane0 > "$OUT/lane0.log" 2>&1 &
lane1 > "$OUT/lane1.log" 2>&1 &
wait
tail -n 30 "$OUT/lane0.log" "$OUT/lane1.log"
