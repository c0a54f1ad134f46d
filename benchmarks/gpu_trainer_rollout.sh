#!/usr/bin/env bash
# Trainer versus rollout on two GPUs, all tbik: the transformers engine (the trainer) and vLLM
# (the rollout) at TP 1 and 2, batch 1, 8, 32, generate and score, every cell compared with the
# transformers TP=1 batch-1 cell of its mode. Then `repaudit diff` of that trainer cell against
# each vLLM batch-1 cell, and the op-for-op check of repaudit.engines.hf_ops on the GPU.
#
#   bash benchmarks/gpu_trainer_rollout.sh                     # writes $OUT/trainer-rollout.tgz
#   TP=1 bash benchmarks/gpu_trainer_rollout.sh                # one GPU
#   RESUME=<run.tar.xz of an earlier call> bash benchmarks/gpu_trainer_rollout.sh
#
# The run:
#   repaudit run --model builtin:qwen3-0.6b --device cuda --engine hf,vllm --tp 1,2
#     --batch-size 1,8,32 --kernels tbik --mode generate,score --probes default
#     --max-new-tokens 16 --topk 5 --baseline hf-tp1-bs1-default-tbik-generate
#     --reference-per kernels,mode
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
left() { echo $(( ${BUDGET:-570} - ($(date +%s) - START) )); }
step() { echo "== $(date +%T) [$(( $(date +%s) - START ))s] $1"; }
W=/tmp/o; R=/tmp/runs/tr; mkdir -p $W $R
bash benchmarks/vllm_install.sh 1 > $W/install.log 2>&1
source benchmarks/vllm_env.sh
nvidia-smi -L > $W/machine.txt
python3 -c 'from repaudit import builtin; builtin.ensure("builtin:qwen3-0.6b")' 2>>$W/install.log
[ -n "${RESUME:-}" ] && xz -dc "$RESUME" | tar -xf - -C $R

step "GPU 0: hf_ops against the transformers engine (pytest); the matrix (groups side by side)"
if [ -z "${RESUME:-}" ]; then
  (CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_hf_ops.py \
     > $W/pytest-hf-ops.log 2>&1; echo "pytest exit $?" >> $W/pytest-hf-ops.log) &
fi
COLUMNS=150 timeout -k 10 $(( $(left) - 40 )) python3 -m repaudit run --model builtin:qwen3-0.6b --device cuda \
  --engine hf,vllm --tp ${TP:-1,2} --batch-size 1,8,32 --kernels tbik --mode generate,score --probes default \
  --max-new-tokens 16 --topk 5 --baseline hf-tp1-bs1-default-tbik-generate --reference-per kernels,mode \
  --timeout 200 --load-timeout 300 --out $R > $W/run.log 2>&1; echo "run exit $?"
wait
tail -n 5 $W/pytest-hf-ops.log 2>/dev/null
grep -v "it/s\]" $W/run.log | tail -n 40
(cd $R && COLUMNS=150 timeout 20 python3 -m repaudit report . > $W/report.log 2>&1)
for f in summary.json summary.md report.html report.md; do [ -f $R/$f ] && cp $R/$f $W/; done
mkdir -p $R/diffs
for mode in generate score; do for t in 1 2; do
  x=$R/cells/hf-tp1-bs1-default-tbik-$mode.parquet; y=$R/cells/vllm-tp$t-bs1-default-tbik-$mode.parquet
  [ -f $x ] && [ -f $y ] || continue
  n=hf-tp1--vllm-tp$t-tbik-$mode
  COLUMNS=150 timeout 10 python3 -m repaudit diff $x $y --json $R/diffs/$n.json > $R/diffs/$n.txt 2>&1; echo "$n exit $?"
  head -n 12 $R/diffs/$n.txt
done; done
for f in $R/jobs/node0/*.log; do grep -v "it/s\]" "$f" | tail -n 80 > $W/job-$(basename "$f"); done
cp $R/manifest.json $W/ 2>/dev/null
tar -C $R -cf - cells diffs manifest.json 2>/dev/null | xz -T0 -3 > $W/run.tar.xz
tar -czf $OUT/trainer-rollout.tgz -C $W .
step done
