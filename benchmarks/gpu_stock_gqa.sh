#!/usr/bin/env bash
# The transformers engine's generate at batch 32 against plain vLLM, on one GPU: the engine on
# vLLM's workload (256 random prompts of 64-512 tokens, 128 new) for stock, bi and tbik, plain vLLM
# on the same workload, where a decode step's time goes (benchmarks/decode_gaps.py), SDPA's bits
# with grouped key/value heads in place against repeated (benchmarks/sdpa_gqa_probe.py; the stock
# mode's attention, repaudit/run/stock_attention.py), then the decode tests on the GPU (stock
# records against model.generate with a static cache; fused against transformers' own ops, every
# mode; graph replays against eager steps). ENGINE_RUNS and VLLM_RUNS: runs a median takes (3, 5);
# VLLM_BUDGET: seconds for vLLM, whose first start on a machine compiles for minutes (250).
#
#   OUT=dir bash benchmarks/gpu_stock_gqa.sh      # with .carry/vllm/part-1.tar.xz carried
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_vllm_setup.sh
step "engine speed, vLLM's workload, generate batch 32"
timeout "${RANDOM_BUDGET:-170}" python3 benchmarks/engine_speed.py --runs "${ENGINE_RUNS:-3}" --kernels stock,bi,tbik --mode generate --batch 32 --chunks 8 --random 256 \
  --new 128 --no-baseline --json "$OUT/engine_speed_random.json" 2>&1 | grep -v Loading
step "plain vLLM, vLLM's workload"
timeout "${VLLM_BUDGET:-250}" python3 benchmarks/vllm_speed.py --model "$MODEL" --tp 1 --kernels stock --prompts 256 \
  --new 128 --runs "${VLLM_RUNS:-5}" --vllm-args '{}' --json "$OUT/vllm_speed.json" 2>&1 | grep -v "it/s\]" | tail -n 4
step "decode step: loop, replay, kernels"
timeout 90 python3 benchmarks/decode_gaps.py --json "$OUT/decode_gaps.json" 2>&1 | grep -v Loading | tail -n 3
step "SDPA: grouped heads in place against repeated"
timeout 60 python3 benchmarks/sdpa_gqa_probe.py --json "$OUT/sdpa_gqa.json" > "$OUT/sdpa_gqa.log" 2>&1
grep -v "^    " "$OUT/sdpa_gqa.log"
step "pytest: decode on the GPU"
timeout "${TEST_BUDGET:-150}" python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_hf_decode.py -k gpu \
  > "$OUT/pytest-decode.log" 2>&1; echo "exit $?" >> "$OUT/pytest-decode.log"; tail -n 2 "$OUT/pytest-decode.log"
step "done"
