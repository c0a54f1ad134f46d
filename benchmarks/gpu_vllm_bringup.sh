#!/usr/bin/env bash
# One GPU: repaudit's vLLM engine through `repaudit run` (TP=1, three kernel modes), the vLLM
# speed benchmark with a JSON fixture of real outputs, and a profile of the transformers engine.
# Everything lands in $OUT/bringup.tgz (logs, summaries, JSON).
set -uo pipefail
cd "$(dirname "$0")/.."
W=/tmp/o; mkdir -p $W
bash benchmarks/vllm_install.sh 1 > $W/install.log 2>&1
source benchmarks/vllm_env.sh
M=$(python3 -c 'from repaudit import builtin; print(builtin.ensure("builtin:qwen3-0.6b"))' 2>>$W/install.log)
nvidia-smi -L > $W/machine.txt
step() { echo "== $(date +%T) $1"; }
step vllm-run
COLUMNS=150 timeout ${T_RUN:-330} python3 -m repaudit run --device cuda --model builtin:qwen3-0.6b --engine vllm --tp 1 \
  --batch-size 1,8 --kernels stock,bi,tbik --mode generate,score --probes default --max-new-tokens 16 --topk 5 \
  --timeout 240 --load-timeout 240 --out /tmp/runs/v1 > $W/v1.log 2>&1; echo "exit $?"
tail -n 30 $W/v1.log
cp /tmp/runs/v1/summary.* /tmp/runs/v1/manifest.json $W/ 2>/dev/null
for f in /tmp/runs/v1/jobs/node0/*.log; do cp "$f" $W/job-$(basename "$f"); done
step vllm-speed
timeout ${T_SPEED:-200} python3 benchmarks/vllm_speed.py --model "$M" --tp 1 --kernels stock,tbik --runs 2 \
  --json $W/vllm_speed.json --fixture $W/vllm_fixture.json > $W/vspeed.log 2>&1; echo "exit $?"
tail -c 3000 $W/vspeed.log
step engine-profile
timeout ${T_HF:-150} python3 benchmarks/engine_speed.py --model builtin:qwen3-0.6b --batch 8 --prompts 8 --runs 1 \
  --profile $W/prof --json $W/engine_speed.json > $W/espeed.log 2>&1; echo "exit $?"
tail -n 12 $W/espeed.log
tar -czf $OUT/bringup.tgz -C $W .
step done
