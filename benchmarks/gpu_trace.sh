#!/usr/bin/env bash
# GPU evidence for --trace / locate: traced TP=1 and TP=2 score cells (stock, tbik) of the bf16
# model, `repaudit locate` on each pair, and the tracing overhead (benchmarks/trace_bench.py).
#
#   OUT=dir TPS=1,2 [REPEATS=3] bash benchmarks/gpu_trace.sh      -> $OUT/trace.md
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}" REPAUDIT_CACHE=/tmp/repaudit-cache
OUT="${OUT:-reports/gpu/latest}"; TPS="${TPS:-1,2}"; REPEATS="${REPEATS:-3}"
mkdir -p "$OUT"
t="$OUT/trace.md"
tcmd=(python3 -m repaudit run --device cuda --model builtin:qwen3-0.6b --tp "$TPS" --batch-size 1 --kernels stock,tbik
      --mode score --probes smoke --trace --out /tmp/runs/trace)
echo "## traced cells: ${tcmd[*]}" > "$t"
COLUMNS=160 timeout 200 "${tcmd[@]}" > "$OUT/trace_run.log" 2>&1
for k in stock tbik; do
    echo -e "\n## repaudit locate hf-tp1-bs1-default-$k-score hf-tp2-bs1-default-$k-score\n\n\`\`\`" >> "$t"
    COLUMNS=150 timeout 60 python3 -m repaudit locate /tmp/runs/trace/cells/hf-tp1-bs1-default-$k-score.parquet \
        /tmp/runs/trace/cells/hf-tp2-bs1-default-$k-score.parquet >> "$t" 2>&1
    echo '```' >> "$t"
done
echo -e "\n## tracing overhead: python3 benchmarks/trace_bench.py --model builtin:qwen3-0.6b --probes default --batch-size 8 --repeats $REPEATS\n" >> "$t"
timeout 240 python3 benchmarks/trace_bench.py --model builtin:qwen3-0.6b --probes default --batch-size 8 --repeats "$REPEATS" 2>&1 | grep "^|" >> "$t"
