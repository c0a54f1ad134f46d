#!/usr/bin/env bash
# Two GPUs: stock and tbik vLLM at TP=2 side by side in one call (benchmarks/gpu_vllm_profile.sh:
# GPU tests of the plugin's ops, speed and per-kernel profile), then, on GPU 0, the tracing
# overhead of the transformers engine with torch.profiler's kernel tables (trace_bench.py).
#   OUT=dir bash benchmarks/gpu_vllm_trace.sh     # .carry/vllm/part-1.tar.xz carried
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_vllm_profile.sh
step "tracing overhead with GPU kernel tables, GPU 0"
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 benchmarks/trace_bench.py --model builtin:qwen3-0.6b --probes default \
  --batch-size 8 --repeats 3 --json "$OUT/trace_overhead.json" --gpu-profile "$OUT/trace_kernels.txt" 2>&1 | grep "^|"
step "all done"
rm -f "$OUT/vllm_install.log"  # machine.txt says whether vLLM imported
