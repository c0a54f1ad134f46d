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
OUT=${OUT:-reports/perf/lanes}; mkdir -p "$OUT"
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
  step "tracing overhead, batch 8"
  timeout "${TRACE_BUDGET:-150}" python3 benchmarks/trace_bench.py --model builtin:qwen3-0.6b --probes default --batch-size 8 \
    --repeats 1 --json "$OUT/trace_overhead.json" 2>&1 | grep -v Loading
  step "lane 1 done"
}

lane0 > "$OUT/lane0.log" 2>&1 &
lane1 > "$OUT/lane1.log" 2>&1 &
wait
