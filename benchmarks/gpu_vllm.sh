#!/usr/bin/env bash
# The vLLM matrix on two GPUs, in two calls of at most ten minutes (each vLLM job spends one to
# two minutes starting: compile, CUDA graphs).
#
#   PHASE=1 bash benchmarks/gpu_vllm.sh    # TP=1 matrix (groups side by side on both GPUs), then
#                                          # the speed of TP=2 tbik against TP=2 stock
#   PHASE=2 RESUME=<run.tar.xz of phase 1> bash benchmarks/gpu_vllm.sh
#                                          # the rest of TP=1 on GPU 0 while GPU 1 runs trainer
#                                          # (transformers TP=1 tbik) versus rollout (vLLM tbik) and
#                                          # the vLLM GPU tests; then TP=2 (tbik first) and the diffs
#   PHASE=3 bash benchmarks/gpu_vllm.sh    # one GPU: the vLLM GPU tests, speed TP=1 stock
#   PHASE=4 bash benchmarks/gpu_vllm.sh    # two GPUs: the vLLM GPU tests on GPU 1 beside speed TP=1
#                                          # (stock, with the fixtures, and tbik) on GPU 0
#   PHASE=5 bash benchmarks/gpu_vllm.sh    # two GPUs: speed TP=2 stock,tbik
#
# The run: `repaudit run --engine vllm --tp 1,2 --batch-size 1,8,32 --kernels stock,bi,tbik
# --mode generate,score` on builtin:qwen3-0.6b, default suite, 16 new tokens, top-5, every score
# cell scoring the tokens of vllm-tp1-bs1-default-tbik-generate. Writes $OUT/phase$PHASE.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
left() { echo $(( ${BUDGET:-570} - ($(date +%s) - START) )); }
step() { echo "== $(date +%T) [$(( $(date +%s) - START ))s] $1"; }
W=/tmp/o; R=/tmp/runs/x; mkdir -p $W $R
bash benchmarks/vllm_install.sh 1 > $W/install.log 2>&1
source benchmarks/vllm_env.sh
nvidia-smi -L > $W/machine.txt
M=$(python3 -c 'from repaudit import builtin; print(builtin.ensure("builtin:qwen3-0.6b"))' 2>>$W/install.log)
[ -n "${RESUME:-}" ] && xz -dc "$RESUME" | tar -xf - -C $R
COMMON=(--device cuda --model builtin:qwen3-0.6b --batch-size 1,8,32 --mode generate,score --probes default
        --max-new-tokens 16 --topk 5 --baseline vllm-tp1-bs1-default-tbik-generate --timeout 200 --load-timeout 240 --out $R)
matrix=(python3 -m repaudit run "${COMMON[@]}" --engine vllm --kernels stock,bi,tbik --reference-per engine,kernels,mode)
speed() {  # TP, kernels, tag
  timeout -k 10 $(( $(left) - 30 )) python3 benchmarks/vllm_speed.py --model "$M" --tp $1 --kernels $2 --prompts 256 \
    --new 128 --runs ${RUNS:-2} --json $W/vllm_speed.json ${4:-} > $W/speed-$3.log 2>&1; echo "speed $3 exit $?"
}
keep() {  # the run directory's summary and reports under a name of their own
  for f in summary.json summary.md report.html report.md; do [ -f $R/$f ] && cp $R/$f $W/$1-$f; done
}

if [ "${PHASE:-1}" = 1 ]; then
  step "matrix TP=1 (groups side by side)"
  COLUMNS=150 timeout -k 10 300 "${matrix[@]}" --tp 1 > $W/run-tp1.log 2>&1; echo "tp1 exit $?"
  grep -v "it/s\]" $W/run-tp1.log | tail -n 30
  (cd $R && COLUMNS=150 python3 -m repaudit report . > $W/report-tp1.log 2>&1); keep tp1
  step "speed TP=2 stock,tbik"
  speed 2 stock,tbik tp2
elif [ "${PHASE:-1}" = 4 ]; then
  step "GPU 1: vLLM GPU tests; GPU 0: speed TP=1 stock (fixtures), tbik"
  (REPAUDIT_VLLM_MODEL="$M" CUDA_VISIBLE_DEVICES=1 timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs \
     tests/test_vllm_engine.py tests/test_vllm_capture.py > $W/pytest.log 2>&1; echo "pytest exit $?" >> $W/pytest.log) &
  CUDA_VISIBLE_DEVICES=0 speed 1 stock,tbik tp1 "--fixture $W/vllm_outputs.json"
  wait; tail -n 4 $W/pytest.log
elif [ "${PHASE:-1}" = 5 ]; then
  step "speed TP=2 stock,tbik"
  speed 2 stock,tbik tp2
elif [ "${PHASE:-1}" = 3 ]; then
  step "vLLM GPU tests"
  REPAUDIT_VLLM_MODEL="$M" timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_vllm_engine.py \
    > $W/pytest.log 2>&1; echo "pytest exit $?"; tail -n 4 $W/pytest.log
  step "speed TP=1 stock: plain, plain with the cell's logprobs, the cell"
  speed 1 stock tp1 "--fixture $W/vllm_fixture.json"
else
  step "GPU 0: matrix TP=1 (resumes); GPU 1: trainer (transformers TP=1 tbik) against rollout (vLLM tbik), vLLM GPU tests"
  T=/tmp/runs/trainer; mkdir -p $T/cells; cp $R/cells/vllm-tp1-*-tbik-*.parquet $T/cells/ 2>/dev/null
  (CUDA_VISIBLE_DEVICES=0 COLUMNS=150 timeout -k 10 240 "${matrix[@]}" --tp 1 > $W/run-tp1.log 2>&1; echo "tp1 exit $?") &
  (REPAUDIT_VLLM_MODEL="$M" CUDA_VISIBLE_DEVICES=1 timeout 230 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs \
     tests/test_vllm_engine.py > $W/pytest.log 2>&1; echo "pytest exit $?" >> $W/pytest.log) &
  COLUMNS=150 CUDA_VISIBLE_DEVICES=1 timeout -k 10 230 python3 -m repaudit run "${COMMON[@]/$R/$T}" --engine vllm,hf \
    --tp 1 --kernels tbik --reference-per kernels,mode > $W/run-trainer.log 2>&1; echo "trainer exit $?"
  grep -v "it/s\]" $W/run-trainer.log | tail -n 20
  for f in summary.json summary.md; do cp $T/$f $W/trainer-$f 2>/dev/null; done
  wait; tail -n 3 $W/pytest.log; grep -v "it/s\]" $W/run-tp1.log | tail -n 12
  step "matrix TP=1,2 (resumes TP=1; tbik first)"
  matrix=(${matrix[@]/stock,bi,tbik/tbik,bi,stock})
  COLUMNS=150 timeout -k 10 $(( $(left) - 35 )) "${matrix[@]}" --tp 1,2 > $W/run-tp12.log 2>&1; echo "tp1,2 exit $?"
  grep -v "it/s\]" $W/run-tp12.log | tail -n 45
  (cd $R && COLUMNS=150 timeout 20 python3 -m repaudit report . > $W/report-tp12.log 2>&1); keep tp12
  mkdir -p $R/diffs; cp $T/cells/hf-*.parquet $R/cells/ 2>/dev/null
  for a in generate score; do for t in 1 2; do for b in generate score; do
    [ $a = generate ] && [ $b = score ] && continue
    x=$R/cells/hf-tp1-bs1-default-tbik-$a.parquet; y=$R/cells/vllm-tp$t-bs1-default-tbik-$b.parquet
    [ -f $x ] && [ -f $y ] || continue
    n=hf-tp1-tbik-$a--vllm-tp$t-tbik-$b
    COLUMNS=150 timeout 10 python3 -m repaudit diff $x $y --json $R/diffs/$n.json > $R/diffs/$n.txt 2>&1; echo "$n exit $?"
  done; done; done
fi
for f in $R/jobs/node0/*.log; do grep -v "it/s\]" "$f" | tail -n 60 > $W/job-$(basename "$f"); done
cp $R/manifest.json $W/ 2>/dev/null
tar -C $R -cf - cells diffs manifest.json 2>/dev/null | xz -T0 -3 > $W/run.tar.xz
tar -czf $OUT/phase${PHASE:-1}.tgz -C $W .
step done
