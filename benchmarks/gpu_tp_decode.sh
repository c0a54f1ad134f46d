#!/usr/bin/env bash
# The transformers engine's decode at TP=2 on two GPUs: each rank's CUDA graph (collectives
# included) against eager static steps, bitwise, every kernel mode; tbik's tree all-reduce
# against NCCL's all_reduce, eager and replayed from graphs; then the engine against plain
# transformers at TP=2 (benchmarks/engine_speed.py under torchrun).
#
#   OUT=dir [NEW=64] [SPEED_BUDGET=330] bash benchmarks/gpu_tp_decode.sh
#
# Writes to $OUT: machine.txt, steps.log, pytest-tp.log, allreduce.{md,json},
# engine_speed.json (reports/perf/engine_speed.json with this machine's TP=2 rows replaced),
# engine_speed.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}" REPAUDIT_CACHE=${REPAUDIT_CACHE:-/tmp/repaudit-cache}
OUT=${OUT:-reports/engine/tp-decode}; mkdir -p "$OUT"
START=$(date +%s)
step() { echo "== $(date +%T) [$(( $(date +%s) - START ))s] $1" | tee -a "$OUT/steps.log"; }
nvidia-smi -L > "$OUT/machine.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' >> "$OUT/machine.txt"
python3 -c 'from repaudit import builtin; builtin.ensure("builtin:qwen3-0.6b")'

step "pytest: TP=2 graph replays vs eager static steps (and TP=1's graph tests)"
timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_hf_decode_tp.py tests/test_hf_decode.py \
  -k "graph" > "$OUT/pytest-tp.log" 2>&1; echo "exit $?" >> "$OUT/pytest-tp.log"; tail -n 3 "$OUT/pytest-tp.log" | tee -a "$OUT/steps.log"

step "tree all-reduce vs NCCL, P=2"
timeout 120 torchrun --standalone --nproc-per-node=2 benchmarks/allreduce.py --iters 200 --out "$OUT/allreduce.md" \
  --json "$OUT/allreduce.json" > "$OUT/allreduce.log" 2>&1; echo "exit $?" >> "$OUT/allreduce.log"

step "engine speed, TP=2"
cp reports/perf/engine_speed.json "$OUT/engine_speed.json"
timeout "${SPEED_BUDGET:-330}" torchrun --standalone --nproc-per-node=2 benchmarks/engine_speed.py --tp 2 \
  --model builtin:qwen3-0.6b --kernels stock,bi,tbik --batch 1,8,32 --chunks 2 --new "${NEW:-64}" --runs 1 \
  --json "$OUT/engine_speed.json" > "$OUT/engine_speed.log" 2>&1
echo "exit $?" >> "$OUT/engine_speed.log"
step "done"
