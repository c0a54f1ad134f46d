#!/usr/bin/env bash
# GPU evidence for mixture of experts (issue #21 item 2) on two GPUs: the built-in Qwen3-MoE-shaped
# model (builtin:qwen3-moe-1.6b: 128 experts, top-8, bf16) at TP 1 and 2, batch 1, 8, 32, stock /
# bi / tbik, generate and score, every cell traced (module digests and each MoE layer's routing);
# each cell is compared with the TP=1 batch-1 cell of its kernel mode and mode. Then
# `repaudit locate` on the pairs that say where MoE bits and routing move: stock vs tbik kernels,
# TP 1 vs 2, batch 1 vs 32 (stock, bi, tbik).
#
#   OUT=dir bash benchmarks/gpu_moe.sh            -> $OUT/moe.md, summary.*, report.*, locate-*.{txt,json}
#   TP=1 OUT=dir bash benchmarks/gpu_moe.sh       # one GPU: the TP pairs are skipped
#
# The run (traced cells are slow on GPUs: NEW caps the generated tokens, BUDGET the call):
#   repaudit run --model builtin:qwen3-moe-1.6b --device cuda --tp 1,2 --batch-size 1,8,32
#     --kernels stock,bi,tbik --mode generate,score --probes default --max-new-tokens 16 --trace
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}" REPAUDIT_CACHE=/tmp/repaudit-cache
OUT="${OUT:-reports/gpu/moe}"; TP="${TP:-1,2}"; NEW="${NEW:-16}"; R=/tmp/runs/moe
START=$(date +%s)
left() { echo $(( ${BUDGET:-540} - ($(date +%s) - START) )); }
mkdir -p "$OUT"
m="$OUT/moe.md"
nvidia-smi -L > "$OUT/machine.txt" 2>&1
# The weights are made once (random, fixed seed) before the clock of the run starts to matter.
python3 -c 'from repaudit import builtin; print(builtin.ensure("builtin:qwen3-moe-1.6b"))' > "$OUT/ensure.log" 2>&1

cmd=(python3 -m repaudit run --model builtin:qwen3-moe-1.6b --device cuda --tp "$TP" --batch-size 1,8,32
     --kernels stock,bi,tbik --mode generate,score --probes default --max-new-tokens "$NEW" --trace
     --timeout 240 --load-timeout 300 --out "$R")
echo "## ${cmd[*]}" > "$m"
echo '```' >> "$m"
COLUMNS=150 timeout -k 10 $(( $(left) - 60 )) "${cmd[@]}" > "$OUT/run.log" 2>&1; echo "run exit $?" >> "$m"
grep -v "it/s\]" "$OUT/run.log" | grep -v "^done " | tail -n 90 >> "$m"
echo '```' >> "$m"

# (A, B) cell pairs for locate: what changes between them is in the file name.
pairs=(
  "hf-tp1-bs1-default-stock-score hf-tp1-bs1-default-tbik-score"
  "hf-tp1-bs1-default-stock-score hf-tp2-bs1-default-stock-score"
  "hf-tp1-bs1-default-stock-score hf-tp1-bs32-default-stock-score"
  "hf-tp1-bs1-default-bi-score hf-tp1-bs32-default-bi-score"
  "hf-tp1-bs1-default-tbik-score hf-tp2-bs32-default-tbik-score"
  "hf-tp1-bs1-default-stock-generate hf-tp2-bs1-default-stock-generate"
  "hf-tp1-bs1-default-tbik-generate hf-tp2-bs32-default-tbik-generate"
)
for p in "${pairs[@]}"; do
  set -- $p
  a=$R/cells/$1.parquet; b=$R/cells/$2.parquet
  [ -f "$a" ] && [ -f "$b" ] || { echo -e "\n(skipped: $1 vs $2, a cell is missing)" >> "$m"; continue; }
  n="locate-$1--$2"
  COLUMNS=150 timeout 60 python3 -m repaudit locate "$a" "$b" --json "$OUT/$n.json" > "$OUT/$n.txt" 2>&1
  echo -e "\n## repaudit locate $1 $2 (exit $?)\n\n\`\`\`" >> "$m"
  # The routing table and the closing sentence; the per-module table is in $n.txt.
  sed -n '/router choices/,$p' "$OUT/$n.txt" >> "$m"
  echo '```' >> "$m"
done

(cd "$R" && COLUMNS=150 timeout 240 python3 -m repaudit report . > "$OUT/report.log" 2>&1)
for f in summary.json summary.md report.html report.md manifest.json; do [ -f "$R/$f" ] && cp "$R/$f" "$OUT/"; done
for f in "$R"/jobs/node0/*.log; do [ -f "$f" ] && grep -v "it/s\]" "$f" | tail -n 60 > "$OUT/job-$(basename "$f")"; done
echo "done in $(( $(date +%s) - START ))s" >> "$m"
