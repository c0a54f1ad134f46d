#!/usr/bin/env bash
# The transformers engine's decode on one GPU: CUDA-graph replays against eager steps (bitwise,
# every kernel mode), tbik's kernels after any change (bitwise invariance), the engine against
# plain transformers (benchmarks/engine_speed.py), and plain vLLM on the same GPU for scale.
#
#   OUT=dir bash benchmarks/gpu_decode.sh        # [VLLM=1] with .carry/vllm/part-1.tar.xz carried
#
# Writes to $OUT: machine.txt, pytest-*.log, engine_speed.json/.log, vllm_speed.json/.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export REPAUDIT_CACHE=${REPAUDIT_CACHE:-/tmp/repaudit-cache}
OUT=${OUT:-reports/perf/decode}; mkdir -p "$OUT"
START=$(date +%s)
step() { echo "== $(date +%T) [$(( $(date +%s) - START ))s] $1"; }
nvidia-smi -L > "$OUT/machine.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' >> "$OUT/machine.txt"
python3 -c 'from repaudit import builtin; builtin.ensure("builtin:qwen3-0.6b")'

step "pytest: graph replays vs eager steps; tbik on the GPU"
timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_hf_decode.py -k graph \
  > "$OUT/pytest-decode.log" 2>&1; echo "exit $?" >> "$OUT/pytest-decode.log"; tail -n 3 "$OUT/pytest-decode.log"
if [ "${TBIK_TESTS:-1}" = 1 ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs -x tests/test_tbik_gpu.py \
    > "$OUT/pytest-tbik-gpu.log" 2>&1; echo "exit $?" >> "$OUT/pytest-tbik-gpu.log"; tail -n 3 "$OUT/pytest-tbik-gpu.log"
fi

step "engine speed, TP=1"
timeout "${SPEED_BUDGET:-300}" python3 benchmarks/engine_speed.py --model builtin:qwen3-0.6b --kernels stock,bi,tbik \
  --batch 1,8,32 --chunks 2 --new "${NEW:-64}" --runs 1 --json "$OUT/engine_speed.json" > "$OUT/engine_speed.log" 2>&1
echo "exit $?" >> "$OUT/engine_speed.log"; cat "$OUT/engine_speed.log" | grep -v Loading | tail -n 20

if [ "${VLLM:-1}" = 1 ]; then
  step "plain vLLM, TP=1, same GPU"
  bash benchmarks/vllm_install.sh 1 > "$OUT/vllm_install.log" 2>&1
  source benchmarks/vllm_env.sh
  model=$(python3 -c 'from repaudit import builtin; print(builtin.ensure("builtin:qwen3-0.6b"))')
  timeout 200 python3 benchmarks/vllm_speed.py --model "$model" --tp 1 --kernels stock --prompts 256 --new 128 --runs 1 \
    --json "$OUT/vllm_speed.json" > "$OUT/vllm_speed.log" 2>&1; echo "exit $?" >> "$OUT/vllm_speed.log"
  grep -v "it/s\]" "$OUT/vllm_speed.log" | tail -n 5
fi
step done
