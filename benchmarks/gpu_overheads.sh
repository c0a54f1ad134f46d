#!/usr/bin/env bash
# Where capture's extra time goes, on ONE GPU: the GPU tests of the launch path, the digest
# kernel and the trace's copy off the device; `--trace` with parts of it left out
# (trace_bench.py --ablate); plain vLLM against a cell, with vLLM's defaults and at
# max_num_seqs=32 (the capture's host seconds per run in the rows). TRACE=0 leaves the trace out;
# ENGINE_PROFILE=1 adds a kernel table of the engine's generate at batch 32 per kernel mode;
# VLLM_PROFILE=1 one of the plain and the cell vLLM runs at max_num_seqs=32 (minutes of
# torch.profiler's processing).
#
#   OUT=dir bash benchmarks/gpu_overheads.sh      # with .carry/vllm/part-1.tar.xz carried
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-reports/perf/overheads}
source benchmarks/gpu_vllm_setup.sh
export CUDA_VISIBLE_DEVICES=0
step "pytest: tbik on the GPU, digest kernel, trace copies, vLLM capture"
timeout "${TEST_BUDGET:-240}" python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_tbik_gpu.py \
  tests/test_digest_kernel.py tests/test_trace.py tests/test_hf_decode.py tests/test_vllm_capture.py \
  -k "gpu or graph or GPU or capture" > "$OUT/pytest.log" 2>&1
echo "exit $?" >> "$OUT/pytest.log"; tail -n 2 "$OUT/pytest.log"
if [ "${TRACE:-1}" = 1 ]; then
  step "trace, batch 8, with parts left out"
  timeout "${TRACE_BUDGET:-200}" python3 benchmarks/trace_bench.py --model builtin:qwen3-0.6b --probes default \
    --batch-size 8 --repeats "${REPEATS:-3}" --ablate --json "$OUT/trace_overhead.json" 2>&1 | grep -v Loading \
    | tee "$OUT/trace.log"
fi
if [ "${ENGINE_PROFILE:-0}" = 1 ]; then
  step "engine generate batch 32: kernel tables"
  timeout "${ENGINE_BUDGET:-150}" "${speed[@]}" --kernels stock,bi,tbik --mode generate --batch 32 --chunks 1 --random 32 \
    --new 128 --no-baseline --profile "$OUT/engine-profile" 2>&1 | grep -v Loading > "$OUT/engine.log"
fi
for args in '{}' '{"max_num_seqs": 32}'; do
  step "vLLM, plain and cell, $args"
  profile=()
  [ "${VLLM_PROFILE:-0}" = 1 ] && [ "$args" != '{}' ] && profile=(--profile "$OUT/vllm-profile")
  timeout "${VLLM_BUDGET:-200}" python3 benchmarks/vllm_speed.py --model "$MODEL" --tp 1 --kernels stock --prompts 256 \
    --new 128 --runs "${VLLM_RUNS:-3}" --vllm-args "$args" --json "$OUT/vllm_speed.json" "${profile[@]}" 2>&1 \
    | grep -v "it/s\]" | grep "run:\|profile\|Error\|error" | tail -n 40 | tee -a "$OUT/vllm.log"
done
step "done"
