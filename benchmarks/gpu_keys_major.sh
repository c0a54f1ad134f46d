#!/usr/bin/env bash
# tbik's paged attention keys-major in vLLM's decode steps, two GPUs: its GPU tests, vLLM at TP=2
# (batch 1 and 32, tbik, generate, vLLM's defaults) against the committed trainer cell (the
# transformers engine at TP=1, reports/vllm/h200x2-trainer-rollout/), the kernel against the
# row-major one in CUDA graphs, then stock and tbik generation side by side (vllm_speed.py).
#   OUT=dir [RUNS=2] bash benchmarks/gpu_keys_major.sh      # .carry/vllm/part-1.tar.xz carried
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_vllm_setup.sh
step "GPU tests: the paged kernel keys-major against row-major, paged against dense"
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_tbik_gpu.py -k "paged" \
  > "$OUT/pytest.log" 2>&1; echo "exit $?" >> "$OUT/pytest.log"; tail -n 2 "$OUT/pytest.log"
step "rollout: vLLM TP=2 batch 1, 32, tbik, against the committed trainer cell"
mkdir -p /tmp/trainer && tar xJf reports/vllm/h200x2-trainer-rollout/cells.tar.xz -C /tmp/trainer
C="--model builtin:qwen3-0.6b --device cuda --kernels tbik --mode generate --probes default --max-new-tokens 16 --topk 5"
COLUMNS=150 timeout -k 5 230 python3 -m repaudit run $C --engine vllm --tp 2 --batch-size 1,32 --timeout 150 \
  --load-timeout 200 --out /tmp/r/vllm > "$OUT/run-vllm.log" 2>&1; echo "vllm exit $?"
trainer_rollout_diffs /tmp/trainer /tmp/r/vllm
step "paged attention: keys-major against row-major"
timeout 60 python3 benchmarks/paged_attention_bench.py --json "$OUT/paged_attention.json"
step "speed: stock and tbik, TP=2"
timeout "${SPEED_BUDGET:-240}" python3 benchmarks/vllm_speed.py --model "$MODEL" --tp 2 --kernels stock,tbik \
  --runs "${RUNS:-2}" --json "$OUT/vllm_speed.json" > "$OUT/speed-tp2.log" 2>&1; echo "speed exit $?"
grep -v "INFO\|WARNING\|it/s\]" "$OUT/speed-tp2.log" | tail -n 8
step done
