#!/usr/bin/env bash
# tbik's RMSNorm with several rows a program, on ONE GPU, no vLLM:
#   1. GPU tests: the norms' bits (eager ops, batch invariance, rows a program, the engine's
#      fused-norm records against transformers' eager norms), and the decode loop's, the score
#      head's and the trace's GPU tests (graph replays against eager steps);
#   2. benchmarks/norm_bench.py: one row a program against the shipped rows, side by side, bits
#      compared;
#   3. the records' bits: transformers TP=1 tbik cells run now, diffed against the committed ones
#      of reports/vllm/h200x2-trainer-rollout/;
#   4. benchmarks/kernels.py sweep on the linear shapes vLLM runs at TP=2 for Qwen3-0.6B
#      (q/k/v and gate/up fused, column shards; o and down row shards) at decode row counts.
#
#   OUT=dir bash benchmarks/gpu_norm.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-reports/kernels/norm}
source benchmarks/gpu_setup.sh
export CUDA_VISIBLE_DEVICES=0

step "pytest: norms, decode loop, score head, trace"
pytest_gpu "norm or rms or gpu or GPU or graph" tests/test_tbik_gpu.py tests/test_hf_decode.py tests/test_hf_ops.py \
  tests/test_hf_head.py tests/test_trace.py tests/test_stop_ids.py

step "RMSNorm: rows a program"
python3 benchmarks/norm_bench.py --json "$OUT/norm_bench.json" 2>&1 | tee "$OUT/norm_bench.md"

step "records: tbik TP=1 cells against the committed ones"
records_against_committed
rm -rf "$OUT/run"

step "tree matmul: vLLM's TP=2 shards at decode shapes"
TP2="qkv:2048:1024,o:1024:1024,gate_up:3072:1024,down:1024:1536"
timeout "${SWEEP_BUDGET:-150}" python3 benchmarks/kernels.py sweep --shapes "$TP2" --ms "64,128,256" \
  --configs "64x128x128 w8 s4 R2 TMA;shipped" --out "$OUT" 2>&1 | tee "$OUT/sweep.log" | grep -v "^|" | tail -n 5
step "done"
