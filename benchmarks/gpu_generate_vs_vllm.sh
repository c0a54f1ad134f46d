#!/usr/bin/env bash
# The transformers engine's generate at batch 32 against plain vLLM, one after the other on ONE
# GPU, on vLLM's workload (benchmarks/vllm_speed.py's 256 random prompts of 64-512 tokens, 128 new
# tokens each): first the decode GPU tests (graph replays against eager steps, stock records
# against model.generate with a static cache) and tbik's fused-op GPU tests, then the engine in
# stock, bi and tbik (batches of 32, CUDA-graph steps), then plain `LLM.generate` with its own
# batching and capped at 32 sequences (the engine's batch).
#
#   OUT=dir [TESTS=0] [VLLM_RUNS=3] bash benchmarks/gpu_generate_vs_vllm.sh      # with .carry/vllm/part-1.tar.xz carried
#
# TESTS=0 leaves the tests out; VLLM_RUNS (default 1) timed vLLM runs per setting, the median kept.
#
# Writes to $OUT: machine.txt, pytest.log, engine_speed_random.json, vllm_speed.json, run.log lines.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-reports/perf/generate-vs-vllm}
source benchmarks/gpu_vllm_setup.sh
export CUDA_VISIBLE_DEVICES=0
if [ "${TESTS:-1}" = 1 ]; then
  step "pytest: decode on the GPU, tbik's fused ops"
  timeout "${TEST_BUDGET:-200}" python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_hf_decode.py \
    tests/test_tbik_gpu.py -k "gpu or graph or rope or rms_norm" > "$OUT/pytest.log" 2>&1
  echo "exit $?" >> "$OUT/pytest.log"; tail -n 3 "$OUT/pytest.log"
fi
step "engine, vLLM's workload, generate batch 32"
timeout "${ENGINE_BUDGET:-150}" "${speed[@]}" --kernels stock,bi,tbik --mode generate --batch 32 --chunks 8 --random 256 \
  --new 128 --no-baseline --json "$OUT/engine_speed_random.json" 2>&1 | grep -v Loading
for args in '{}' '{"max_num_seqs": 32}'; do
  step "plain vLLM, vLLM's workload, $args"
  timeout "${VLLM_BUDGET:-150}" python3 benchmarks/vllm_speed.py --model "$MODEL" --tp 1 --kernels stock --prompts 256 \
    --new 128 --runs "${VLLM_RUNS:-1}" --vllm-args "$args" --json "$OUT/vllm_speed.json" 2>&1 | grep -v "it/s\]" | tail -n 3
done
step "done"
