#!/usr/bin/env bash
# Two GPUs of one host, no vLLM. PART=lanes (default):
#   lane 0 (GPU 0): the engine's score rows at TP=1 against a plain forward (stock, bi, tbik;
#     batch 1, 8, 32; median of RUNS);
#   lane 1 (GPU 1): the GPU tests of the record values' kernels, the fused norms and the graph
#     replays, then the engine's decode at batch 32 on 64 random prompts of 64-512 tokens.
# PART=tp2: the score rows at TP=2 on both GPUs.
# PART=one (one GPU): lane 1's tests with tbik's fused-op GPU tests, its decode rows, then the
# engine's generate rows against plain model.generate for bi and tbik (batch 1, 8, 32).
# PART=score1 (one GPU): lane 1's tests, the record values' kernel times
#   (row_values_bench.json), then lane 0's score rows.
# PROFILE=1: torch.profiler tables of the score rows at batch 8 (profile-*.txt).
#
#   OUT=dir [PART=lanes|tp2|one|score1] [RUNS=3] [PROFILE=1] bash benchmarks/gpu_score.sh
#
# Writes to $OUT: machine.txt, lane0.log, lane1.log (pytest.log), tp2.log, and engine_speed.json
# (reports/perf/engine_speed.json with this machine's measured cells replaced; lane 1's decode
# rows go to decode.json, merged by hand: two processes never write one file).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-reports/perf/score}
PART=${PART:-lanes}
source benchmarks/gpu_setup.sh
[ -f "$OUT/engine_speed.json" ] || cp reports/perf/engine_speed.json "$OUT/"
speed=(python3 benchmarks/engine_speed.py --model builtin:qwen3-0.6b)
profile=(); [ -n "${PROFILE:-}" ] && profile=(--profile "$OUT/profiles")

lane0() {
  export CUDA_VISIBLE_DEVICES=0
  step "engine speed, score, TP=1"
  timeout "${SCORE_BUDGET:-330}" "${speed[@]}" --mode score --kernels stock,bi,tbik --batch 1,8,32 --runs "${RUNS:-3}" \
    "${profile[@]}" --json "$OUT/engine_speed.json" 2>&1 | grep -v Loading
  step "lane 0 done"
}
gpu_tests() {
  step "pytest: record values, grouped head, fused norms, graph replays"
  TEST_BUDGET=${TEST_BUDGET:-200} pytest_gpu "gpu or graph or rope or rms_norm" tests/test_row_values.py \
    tests/test_hf_head.py tests/test_hf_decode.py tests/test_tbik_gpu.py
}
lane1() {
  export CUDA_VISIBLE_DEVICES=${LANE1_GPU:-1}
  gpu_tests
  step "engine speed, generate, batch 32, random prompts"
  timeout "${DECODE_BUDGET:-120}" "${speed[@]}" --mode generate --kernels stock,bi,tbik --batch 32 --chunks 2 --random 64 \
    --new 128 --runs 1 --no-baseline --json "$OUT/decode.json" 2>&1 | grep -v Loading
  step "lane 1 done"
}

if [ "$PART" = lanes ]; then
  lane0 > "$OUT/lane0.log" 2>&1 &
  lane1 > "$OUT/lane1.log" 2>&1 &
  wait
  tail -n 4 "$OUT/lane0.log" "$OUT/lane1.log"
elif [ "$PART" = score1 ]; then
  CUDA_VISIBLE_DEVICES=0 gpu_tests > "$OUT/lane1.log" 2>&1
  tail -n 2 "$OUT/lane1.log"
  step "record values' kernel times"
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/row_values_bench.py --rows 1,32,1100 --json "$OUT/row_values_bench.json" \
    > "$OUT/row_values_bench.log" 2>&1
  lane0 > "$OUT/lane0.log" 2>&1
  grep -o '"kernels": "[a-z]*", "mode": "score", "tp": 1, "batch": [0-9]*\|"ratio": [0-9.]*' "$OUT/lane0.log" | paste - -
elif [ "$PART" = one ]; then
  LANE1_GPU=0 lane1 > "$OUT/lane1.log" 2>&1
  tail -n 6 "$OUT/lane1.log"
  step "engine speed, generate, bi and tbik, TP=1"
  CUDA_VISIBLE_DEVICES=0 timeout "${GENERATE_BUDGET:-240}" "${speed[@]}" --mode generate --kernels bi,tbik --batch 1,8,32 \
    --new 64 --runs "${RUNS:-3}" --json "$OUT/engine_speed.json" 2>&1 | grep -v Loading > "$OUT/generate.log"
  grep -o '"kernels": "[a-z]*", "mode": "generate", "tp": 1, "batch": [0-9]*\|"ratio": [0-9.]*' "$OUT/generate.log" | paste - -
else
  step "engine speed, score, TP=2"
  timeout "${TP2_BUDGET:-400}" torchrun --standalone --nproc-per-node 2 benchmarks/engine_speed.py --tp 2 \
    --model builtin:qwen3-0.6b --mode score --kernels stock,bi,tbik --batch 1,8,32 --runs "${RUNS:-3}" \
    "${profile[@]}" --json "$OUT/engine_speed.json" 2>&1 | grep -v Loading > "$OUT/tp2.log"
  grep -o '"kernels": "[a-z]*", "mode": "score", "tp": 2, "batch": [0-9]*\|"ratio": [0-9.]*' "$OUT/tp2.log" | paste - -
fi
step "done"
