#!/usr/bin/env bash
# tbik's RMSNorm launch, on ONE GPU, no vLLM:
#   1. GPU tests: the norms' bits (eager ops, batch invariance, the launch shapes, the engine's
#      fused-norm records against transformers' eager norms), and the decode loop's, the score
#      head's and the trace's GPU tests (graph replays against eager steps);
#   2. benchmarks/norm_bench.py --sweep: the earlier launch against the shipped one, side by side,
#      bits compared, and the warps x rows-a-program grid;
#   3. the records' bits: transformers TP=1 tbik cells run now, diffed against the committed ones
#      of reports/vllm/h200x2-trainer-rollout/.
#
#   OUT=dir bash benchmarks/gpu_norm.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-reports/kernels/norm}
source benchmarks/gpu_setup.sh
export CUDA_VISIBLE_DEVICES=0

step "pytest: norms, decode loop, score head, trace"
pytest_gpu "norm or rms or gpu or GPU or graph" tests/test_tbik_gpu.py tests/test_hf_decode.py tests/test_hf_ops.py \
  tests/test_hf_head.py tests/test_trace.py tests/test_stop_ids.py

step "RMSNorm: launches"
python3 benchmarks/norm_bench.py --sweep --json "$OUT/norm_bench.json" 2>&1 | tee "$OUT/norm_bench.md"

step "records: tbik TP=1 cells against the committed ones"
records_against_committed
rm -rf "$OUT/run"
step "done"
