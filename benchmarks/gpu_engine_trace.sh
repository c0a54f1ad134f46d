#!/usr/bin/env bash
# One GPU, no vLLM: the CUDA-graph and digest-kernel GPU tests, the tracing overhead
# (benchmarks/trace_bench.py, default suite, batch 8) and the transformers engine against plain
# transformers at TP=1 (benchmarks/engine_speed.py, every kernel mode, batch 1/8/32).
#
#   OUT=dir [PROFILE=1] [TRACE_PROFILE=1] [KERNELS=..] [MODES=..] [SPEED_BUDGET=s, 0: none] bash benchmarks/gpu_engine_trace.sh
#     -> $OUT/{machine.txt,pytest.log,trace.log,trace_overhead.json,engine.log,engine_speed.json[,profile/]}
# PROFILE=1 adds a torch.profiler table of repaudit's stock generate at batch 32 on long prompts;
# TRACE_PROFILE=1 a cProfile of one traced cell per mode (trace_bench.py --profile).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 REPAUDIT_CACHE=/tmp/repaudit-cache
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-reports/gpu/latest}"
mkdir -p "$OUT"
START=$(date +%s)
step() { echo "== $(date +%T) [$(( $(date +%s) - START ))s] $1"; }
nvidia-smi -L > "$OUT/machine.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__)' >> "$OUT/machine.txt" 2>&1
step "pytest: graph replays, traced replays, digest kernel"
timeout "${TEST_BUDGET:-240}" python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_hf_decode.py \
  tests/test_digest_kernel.py tests/test_tbik_gpu.py -k "graph or digest" > "$OUT/pytest.log" 2>&1
echo "exit $?" >> "$OUT/pytest.log"; tail -n 2 "$OUT/pytest.log"
step "tracing overhead, batch 8"
timeout "${TRACE_BUDGET:-200}" python3 benchmarks/trace_bench.py --model builtin:qwen3-0.6b --probes default --batch-size 8 \
  --repeats "${REPEATS:-3}" ${TRACE_PROFILE:+--profile} --json "$OUT/trace_overhead.json" > "$OUT/trace.log" 2>&1
grep "^|" "$OUT/trace.log"
if [ "${SPEED_BUDGET:-300}" != 0 ]; then
  step "engine speed, TP=1"
  timeout "${SPEED_BUDGET:-300}" python3 benchmarks/engine_speed.py --model builtin:qwen3-0.6b --runs "${RUNS:-3}" \
    --kernels "${KERNELS:-stock,bi,tbik}" --mode "${MODES:-score,generate}" --batch 1,8,32 --new 64 \
    --json "$OUT/engine_speed.json" > "$OUT/engine.log" 2>&1
  echo "exit $?" >> "$OUT/engine.log"; grep -v Loading "$OUT/engine.log" | tail -n 25
fi
if [ -n "${PROFILE:-}" ]; then
  step "profile: generate, batch 32, 32 random prompts of 64-512 tokens, 128 new"
  timeout 200 python3 benchmarks/engine_speed.py --model builtin:qwen3-0.6b --runs 1 --kernels stock --mode generate \
    --batch 32 --chunks 1 --random 32 --new 128 --no-baseline --profile "$OUT/profile" > "$OUT/profile.log" 2>&1
  echo "exit $?" >> "$OUT/profile.log"; tail -n 3 "$OUT/profile.log"
fi
step done
