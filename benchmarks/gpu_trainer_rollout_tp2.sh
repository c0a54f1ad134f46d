#!/usr/bin/env bash
# Trainer versus rollout at TP=2, tbik, lean: the transformers engine at TP=1 batch 1 (GPU 0),
# then vLLM at TP=2 batch 1 and 32 (both GPUs), then `repaudit diff` of the trainer cell against
# each rollout cell.   OUT=dir bash benchmarks/gpu_trainer_rollout_tp2.sh  (.carry/vllm/part-1.tar.xz carried)
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_vllm_setup.sh
step "trainer: transformers TP=1 batch 1, tbik"
C="--model builtin:qwen3-0.6b --device cuda --kernels tbik --mode generate --probes default --max-new-tokens 16 --topk 5"
COLUMNS=150 CUDA_VISIBLE_DEVICES=0 timeout -k 5 100 python3 -m repaudit run $C --engine hf --tp 1 --batch-size 1 --out /tmp/r/hf > "$OUT/run-hf.log" 2>&1; echo "hf exit $?"
step "rollout: vLLM TP=2 batch 1, 32, tbik"
rollout_tp2 /tmp/r/vllm --model builtin:qwen3-0.6b
grep -v "it/s\]" "$OUT/run-vllm.log" | tail -n 6
trainer_rollout_diffs /tmp/r/hf /tmp/r/vllm
step done
