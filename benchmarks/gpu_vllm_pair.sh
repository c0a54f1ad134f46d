#!/usr/bin/env bash
# Two GPUs: vLLM stock and tbik at TP=2 side by side in one call (benchmarks/vllm_speed.py, 256
# random prompts of 64-512 tokens, 128 new, median of 3), then trainer versus rollout at TP=2:
# the transformers engine at TP=1 and vLLM at TP=1 and 2, tbik, generate, batch 1 and 32,
# every cell gated against the transformers TP=1 batch-1 cell, and `repaudit diff` of that
# cell against vLLM's TP=2 cells.
#
#   OUT=dir bash benchmarks/gpu_vllm_pair.sh      # .carry/vllm/part-1.tar.xz carried
#
# Writes to $OUT: machine.txt, speed-tp2.log, vllm_speed.json (reports/perf/vllm_speed.json with
# this call's rows appended), run.log, summary.md, diff-*.txt.
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_vllm_setup.sh
cp reports/perf/vllm_speed.json "$OUT/"
step "vLLM stock,tbik TP=2: speed"
speed_tp2
step "trainer (transformers TP=1) versus rollout (vLLM TP=1, 2), tbik"
R=/tmp/runs/pair; rm -rf $R
COLUMNS=150 timeout -k 10 "${RUN_BUDGET:-240}" python3 -m repaudit run --model builtin:qwen3-0.6b --device cuda \
  --engine hf,vllm --tp 1,2 --batch-size 1,32 --kernels tbik --mode generate --probes default --max-new-tokens 16 \
  --topk 5 --baseline hf-tp1-bs1-default-tbik-generate --timeout 200 --load-timeout 300 --out $R > "$OUT/run.log" 2>&1
echo "run exit $?"; grep -v "it/s\]" "$OUT/run.log" | tail -n 25
[ -f $R/summary.md ] && cp $R/summary.md "$OUT/"
for b in 1 32; do
  x=$R/cells/hf-tp1-bs1-default-tbik-generate.parquet; y=$R/cells/vllm-tp2-bs$b-default-tbik-generate.parquet
  [ -f $x ] && [ -f $y ] && COLUMNS=150 timeout 20 python3 -m repaudit diff $x $y > "$OUT/diff-vllm-tp2-bs$b.txt" 2>&1
  head -n 8 "$OUT/diff-vllm-tp2-bs$b.txt" 2>/dev/null
done
step done
