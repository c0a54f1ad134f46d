#!/usr/bin/env bash
# The keys-major attention kernels on one GPU: the attention and decode-graph GPU tests (the new
# kernels' bits against the row-major ones among them), the transformers engine's tbik records
# against the committed ones of reports/vllm/h200x2-trainer-rollout/, and both kernels' GPU times.
#   OUT=dir bash benchmarks/gpu_keys_major.sh
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_setup.sh
step "GPU tests: attention, keys-major, decode graphs"
TEST_BUDGET=300 pytest_gpu "attention or keys_major or graph or decode" tests/test_tbik_gpu.py tests/test_hf_decode.py
step "the transformers engine's tbik records against the committed ones"
records_against_committed
grep -h "bitwise-equal logprobs" "$OUT"/diff-*.txt
step "paged attention (vLLM's shapes)"
timeout 120 python3 benchmarks/paged_attention_bench.py --json "$OUT/paged_attention.json"
step "attention (the transformers engine's shapes)"
timeout 120 python3 benchmarks/attention_bench.py --json "$OUT/attention.json"
step done
