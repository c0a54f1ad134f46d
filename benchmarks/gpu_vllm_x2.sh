#!/usr/bin/env bash
# Two GPUs: the vLLM matrix TP 1,2 x batch 1,8,32 x bi,tbik x generate,score through `repaudit run`
# (vLLM's defaults: torch.compile, CUDA graphs, FA3), trainer-versus-rollout diffs against the
# transformers TP=1 records in $HF_CELLS (a cells.tar.xz of an earlier run), and, on the second
# GPU while the TP=1 groups run on the first, the vLLM speed benchmark with a JSON fixture.
# Writes $OUT/x2.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
W=/tmp/o; mkdir -p $W /tmp/hf
bash benchmarks/vllm_install.sh 1 > $W/install.log 2>&1
source benchmarks/vllm_env.sh
M=$(python3 -c 'from repaudit import builtin; print(builtin.ensure("builtin:qwen3-0.6b"))' 2>>$W/install.log)
nvidia-smi -L > $W/machine.txt
[ -n "${HF_CELLS:-}" ] && xz -dc "$HF_CELLS" | tar -xf - -C /tmp/hf
step() { echo "== $(date +%T) $1"; }
step speed-and-tp1
(CUDA_VISIBLE_DEVICES=1 timeout -k 10 ${T_SPEED:-230} python3 benchmarks/vllm_speed.py --model "$M" --tp 1 \
   --kernels stock,tbik --prompts 256 --runs 2 --json $W/vllm_speed.json --fixture $W/vllm_fixture.json > $W/speed.log 2>&1) &
speed=$!
run=(python3 -m repaudit run --device cuda --model builtin:qwen3-0.6b --engine vllm --batch-size 1,8,32 --kernels bi,tbik
     --mode generate,score --probes default --max-new-tokens 16 --topk 5 --timeout 200 --load-timeout 240
     --reference-per engine,kernels,mode --out /tmp/runs/x)
CUDA_VISIBLE_DEVICES=0 COLUMNS=150 timeout ${T_TP1:-250} "${run[@]}" --tp 1 > $W/run-tp1.log 2>&1; echo "tp1 exit $?"
wait $speed; echo "speed exit $?"; tail -c 1500 $W/speed.log
step tp2
COLUMNS=150 timeout ${T_TP2:-290} "${run[@]}" --tp 1,2 > $W/run-tp12.log 2>&1; echo "tp1,2 exit $?"
grep -v "it/s\]" $W/run-tp12.log | tail -n 25
COLUMNS=150 timeout 60 python3 -m repaudit report /tmp/runs/x > $W/report.log 2>&1
mkdir -p /tmp/runs/x/diffs
for a in /tmp/hf/cells/hf-tp1-bs1-default-tbik-*.parquet /tmp/hf/cells/vllm-tp1-bs1-default-stock-*.parquet; do
  mode=${a##*-}
  for b in /tmp/runs/x/cells/vllm-tp*-bs*-default-tbik-$mode; do
    n="$(basename "${a%.parquet}")--$(basename "${b%.parquet}")"
    COLUMNS=150 timeout 30 python3 -m repaudit diff "$a" "$b" --json /tmp/runs/x/diffs/$n.json > /tmp/runs/x/diffs/$n.txt 2>&1
    echo "$n exit $?"
  done
done
for f in /tmp/runs/x/jobs/node0/*.log; do grep -v "it/s\]" "$f" | tail -n 40 > $W/job-$(basename "$f"); done
tar -C /tmp/runs/x -cf - cells diffs manifest.json summary.json summary.md report.html report.md 2>/dev/null | xz -T0 -3 > $W/run.tar.xz
tar -czf $OUT/x2.tgz -C $W .
step done
