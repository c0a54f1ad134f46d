#!/usr/bin/env bash
# One GPU: vLLM `tbik` cells (repaudit's plugin under vLLM's defaults) at TP=1, batch 1,8,32,
# generate and score, and `repaudit diff` of the transformers tbik TP=1 records in $HF_CELLS
# (a cells.tar.xz of an earlier run) against them. Writes $OUT/tbik.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
W=/tmp/o; mkdir -p $W /tmp/hf
bash benchmarks/vllm_install.sh 1 > $W/install.log 2>&1
source benchmarks/vllm_env.sh
nvidia-smi -L > $W/machine.txt
[ -n "${HF_CELLS:-}" ] && xz -dc "$HF_CELLS" | tar -xf - -C /tmp/hf
COLUMNS=150 timeout ${T_RUN:-200} python3 -m repaudit run --device cuda --model builtin:qwen3-0.6b --engine vllm --tp 1 \
  --batch-size 1,8,32 --kernels tbik --mode generate,score --probes default --max-new-tokens 16 --topk 5 \
  --timeout 150 --load-timeout 180 --out /tmp/runs/t > $W/run.log 2>&1; echo "run exit $?"
grep -v "it/s\]" $W/run.log | tail -n 14
mkdir -p /tmp/runs/t/diffs
for m in generate score; do
  for b in /tmp/runs/t/cells/vllm-tp1-bs*-default-tbik-$m.parquet; do
    [ -f "$b" ] || continue
    n="hf-tp1-bs1-default-tbik-$m--$(basename "${b%.parquet}")"
    COLUMNS=150 timeout 20 python3 -m repaudit diff /tmp/hf/cells/hf-tp1-bs1-default-tbik-$m.parquet "$b" \
      --json /tmp/runs/t/diffs/$n.json > /tmp/runs/t/diffs/$n.txt 2>&1; echo "$n exit $?"
  done
done
grep -E "bitwise-equal logprobs|sequences token|RL KL|RL ratio" /tmp/runs/t/diffs/*bs1*.txt
for f in /tmp/runs/t/jobs/node0/*.log; do grep -v "it/s\]" "$f" | tail -n 40 > $W/job-$(basename "$f"); done
tar -C /tmp/runs/t -cf - cells diffs manifest.json summary.json summary.md 2>/dev/null | xz -T0 -3 > $W/run.tar.xz
tar -czf $OUT/tbik.tgz -C $W .
