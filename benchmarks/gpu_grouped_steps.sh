#!/usr/bin/env bash
# A decode step's two grouped launches, on ONE GPU, no vLLM: tbik's attention with a key/value
# head's query heads in one tile, and a traced step's digests in one launch per element width.
#   1. GPU tests: tbik's attention invariances and paged-vs-padded bits, the digest kernels
#      (digest_many replayed from a graph), the trace's and the decode's graph tests (graph
#      replays against eager steps, traced and untraced, every kernel mode);
#   2. the records' bits: transformers TP=1 tbik cells run now, diffed against the committed
#      ones of reports/vllm/h200x2-trainer-rollout/ (made before both changes);
#   3. benchmarks/attention_bench.py: the grouped tile against one query head a tile;
#   4. benchmarks/trace_bench.py, batch 8, with --ablate.
#
#   OUT=dir bash benchmarks/gpu_grouped_steps.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-reports/engine/grouped-steps}
source benchmarks/gpu_setup.sh
export CUDA_VISIBLE_DEVICES=0

step "pytest: attention, digest kernels, trace and decode graphs"
pytest_gpu "attention or gpu or graph or GPU" tests/test_tbik_gpu.py tests/test_digest_kernel.py tests/test_trace.py \
  tests/test_hf_decode.py

step "records: tbik TP=1 cells against the committed ones"
old=$(mktemp -d)
tar xJf reports/vllm/h200x2-trainer-rollout/cells.tar.xz -C "$old"
timeout "${RUN_BUDGET:-150}" python3 -m repaudit run --model builtin:qwen3-0.6b --device cuda --engine hf --tp 1 \
  --batch-size 1,32 --kernels tbik --mode generate,score --probes default --max-new-tokens 16 --topk 5 \
  --out "$OUT/run" > "$OUT/run.log" 2>&1
echo "exit $?" >> "$OUT/run.log"; tail -n 2 "$OUT/run.log"
for cell in hf-tp1-bs1-default-tbik-generate hf-tp1-bs32-default-tbik-generate hf-tp1-bs32-default-tbik-score; do
  python3 -m repaudit diff "$old/cells/$cell.parquet" "$OUT/run/cells/$cell.parquet" > "$OUT/diff-$cell.txt" 2>&1
  echo "$cell: diff exit $?" | tee -a "$OUT/diffs.log"
done
rm -rf "$OUT/run/cells"/*.trace.parquet

step "attention: grouped tile against one head a tile"
timeout 90 python3 benchmarks/attention_bench.py --stages "${STAGES:-2,3}" --json "$OUT/attention.json" 2>&1 \
  | tee "$OUT/attention.log"

step "trace, batch 8, with parts left out"
timeout "${TRACE_BUDGET:-200}" python3 benchmarks/trace_bench.py --model builtin:qwen3-0.6b --probes default \
  --batch-size 8 --repeats "${REPEATS:-3}" --ablate --json "$OUT/trace_overhead.json" 2>&1 | grep -v Loading \
  | tee "$OUT/trace.log"
step "done"
