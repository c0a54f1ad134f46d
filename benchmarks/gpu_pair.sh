#!/usr/bin/env bash
# Two GPUs of one host, one call:
#   lane 0 (GPU 0): the tree matmul against cuBLAS (benchmarks/kernels.py bench, median of 3);
#   lane 1 (GPU 1): the vLLM GPU tests (tests/test_vllm_engine.py, tests/test_vllm_capture.py);
#   then both GPUs: the engine benchmark's score rows at TP=2 (stock, bi, tbik; batch 1, 8, 32)
#   and the tree all-reduce against NCCL (benchmarks/allreduce.py, P=2).
#
#   OUT=dir bash benchmarks/gpu_pair.sh      # with .carry/vllm/part-1.tar.xz carried
#
# Writes to $OUT: machine.txt, lane0.log, lane1.log, bench.md, pytest-vllm.log, tp2.log and the
# committed reports/perf files with this machine's rows replaced: tbik_matmul.json,
# engine_speed.json, allreduce.json (allreduce.md: the table).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-reports/perf/pair}
source benchmarks/gpu_vllm_setup.sh
export PYTHONPATH="$PWD/kernels:$PWD${PYTHONPATH:+:$PYTHONPATH}"
cp reports/perf/tbik_matmul.json reports/perf/engine_speed.json reports/perf/allreduce.json "$OUT/"
lane0() {
  export CUDA_VISIBLE_DEVICES=0
  step "tree matmul against cuBLAS"
  timeout "${BENCH_BUDGET:-200}" python3 benchmarks/kernels.py bench --repeat 3 --out "$OUT" \
    --json "$OUT/tbik_matmul.json" 2>&1 | grep "geometric mean"
  step "lane 0 done"
}
lane1() {
  export CUDA_VISIBLE_DEVICES=1
  step "pytest: vLLM on the GPU"
  REPAUDIT_VLLM_MODEL="$MODEL" timeout "${VLLM_TESTS_BUDGET:-260}" python3 -m pytest -q -p no:cacheprovider -o addopts="" \
    -rs tests/test_vllm_engine.py tests/test_vllm_capture.py > "$OUT/pytest-vllm.log" 2>&1
  echo "exit $?" >> "$OUT/pytest-vllm.log"; tail -n 3 "$OUT/pytest-vllm.log"
  step "lane 1 done"
}
run_lanes
step "engine speed, score, TP=2"
timeout "${TP2_BUDGET:-200}" torchrun --standalone --nproc-per-node 2 benchmarks/engine_speed.py --tp 2 \
  --model builtin:qwen3-0.6b --mode score --kernels stock,bi,tbik --batch 1,8,32 --runs 3 \
  --json "$OUT/engine_speed.json" 2>&1 | grep -v Loading > "$OUT/tp2.log"
grep -o '"kernels": "[a-z]*", "mode": "score", "tp": 2, "batch": [0-9]*\|"ratio": [0-9.]*' "$OUT/tp2.log" | paste - -
step "tree all-reduce against NCCL"
timeout "${ALLREDUCE_BUDGET:-90}" torchrun --standalone --nproc-per-node 2 benchmarks/allreduce.py --iters 200 \
  --out "$OUT/allreduce.md" --json "$OUT/allreduce.json" 2>&1 | tail -n 12
step "done"
