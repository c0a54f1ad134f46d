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
records_against_committed
rm -rf "$OUT/run/cells"/*.trace.parquet

step "attention: grouped tile against one head a tile"
timeout 90 python3 benchmarks/attention_bench.py --stages "${STAGES:-2,3}" --json "$OUT/attention.json" 2>&1 \
  | tee "$OUT/attention.log"

step "trace, batch 8, with parts left out"
timeout "${TRACE_BUDGET:-200}" python3 benchmarks/trace_bench.py --model builtin:qwen3-0.6b --probes default \
  --batch-size 8 --repeats "${REPEATS:-3}" --ablate --json "$OUT/trace_overhead.json" 2>&1 | grep -v Loading \
  | tee "$OUT/trace.log"
step "done"
