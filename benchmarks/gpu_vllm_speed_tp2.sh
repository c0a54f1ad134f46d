#!/usr/bin/env bash
# Two GPUs: vLLM stock and tbik at TP=2 side by side in one call (benchmarks/vllm_speed.py, 256
# random prompts of 64-512 tokens, 128 new, median of 3), then vLLM at TP=2 (tbik, generate,
# batch 1 and 32, vLLM's defaults) against the committed trainer cell (the transformers engine at
# TP=1, reports/vllm/h200x2-trainer-rollout/).
#
#   OUT=dir bash benchmarks/gpu_vllm_speed_tp2.sh      # .carry/vllm/part-1.tar.xz carried
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_vllm_setup.sh
step "vLLM stock,tbik TP=2: speed"
timeout "${SPEED_BUDGET:-420}" python3 benchmarks/vllm_speed.py --model "$MODEL" --tp 2 --kernels stock,tbik --runs 3 \
  --json "$OUT/vllm_speed.json" > "$OUT/speed-tp2.log" 2>&1
echo "exit $?" >> "$OUT/speed-tp2.log"
grep -E "run:|^exit" "$OUT/speed-tp2.log" | tail -n 8
step "rollout: vLLM TP=2 batch 1, 32, tbik, against the committed trainer cell"
mkdir -p /tmp/trainer && tar xJf reports/vllm/h200x2-trainer-rollout/cells.tar.xz -C /tmp/trainer
rm -rf /tmp/r/vllm
COLUMNS=150 timeout -k 5 "${RUN_BUDGET:-230}" python3 -m repaudit run --model builtin:qwen3-0.6b --device cuda \
  --kernels tbik --mode generate --probes default --max-new-tokens 16 --topk 5 --engine vllm --tp 2 --batch-size 1,32 \
  --timeout 150 --load-timeout 200 --out /tmp/r/vllm > "$OUT/run-vllm.log" 2>&1; echo "vllm exit $?"
trainer_rollout_diffs /tmp/trainer /tmp/r/vllm
step done
