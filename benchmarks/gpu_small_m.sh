#!/usr/bin/env bash
# The tree matmul's tiles for few rows (decode), on ONE GPU, no vLLM:
#   1. GPU tests: tbik's kernels (the new tiles' bits across the switch among them), the digest
#      kernels, the decode graphs (traced and untraced replays against eager steps);
#   2. benchmarks/kernels.py sweep on Qwen3-0.6B's linear shapes (and q/k/v, gate/up fused) at
#      decode row counts: 64x128 tiles for every M against the shipped choice by rows, each
#      checked for the first one's bits, and the SPLIT table of the shipped tiles;
#   3. benchmarks/tiles_ab.py: the engine's batch-32 generate with either tile choice, side by
#      side, records compared bit for bit;
#   4. with PROFILE=1, torch.profiler's kernel table of a batch-32 generation per kernel mode.
#
#   OUT=dir [PROFILE=1] [TESTS_K="pytest -k expression"] bash benchmarks/gpu_small_m.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-reports/kernels/small-m}
source benchmarks/gpu_setup.sh
export CUDA_VISIBLE_DEVICES=0

step "pytest: tbik kernels, digest kernels, decode graphs"
pytest_gpu "${TESTS_K:-gpu or graph or GPU or tiles or matmul or rows or attention}" tests/test_tbik_gpu.py \
  tests/test_digest_kernel.py tests/test_hf_decode.py

step "tree matmul: tiles at decode shapes"
QWEN06="q:2048:1024,kv:1024:1024,o:1024:2048,gate:3072:1024,down:1024:3072,qkv:4096:1024,gate_up:6144:1024"
timeout "${SWEEP_BUDGET:-200}" python3 benchmarks/kernels.py sweep --shapes "${SHAPES:-$QWEN06}" --ms "${MS:-1,32,64,256}" \
  --configs "${CONFIGS:-64x128x128 w8 s4 R2 TMA;shipped}" --out "$OUT" 2>&1 | tee "$OUT/sweep.log" | grep -v "^|" | tail -n 5

step "engine: generate at batch 32, either tile choice, side by side"
timeout "${AB_BUDGET:-200}" python3 benchmarks/tiles_ab.py --kernels tbik,bi --batch 32 --random 64 --new 128 --runs 3 \
  --json "$OUT/tiles_ab.json" 2>&1 | grep -v Loading | tee "$OUT/tiles_ab.log"

if [ "${PROFILE:-0}" = 1 ]; then
  step "engine: profile of a batch-32 generation"
  for k in tbik stock; do
    timeout 120 python3 benchmarks/engine_speed.py --kernels "$k" --mode generate --batch 32 --chunks 1 --random 32 \
      --new 128 --runs 1 --no-baseline --profile "$OUT/profile" 2>&1 | grep -v Loading | tee -a "$OUT/profile.log"
  done
fi
step "done"
