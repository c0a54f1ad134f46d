# Sourced by GPU scripts without vLLM (gpu_score.sh, gpu_grouped_steps.sh, gpu_norm.sh, ...) from
# the repository root with OUT set: the environment (NVLink multicast off, tbik on the path), timed
# step lines, pytest_gpu, records_against_committed, the machine and versions in $OUT/machine.txt,
# and the built-in Qwen3-0.6B-shaped model made.
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 REPAUDIT_CACHE=${REPAUDIT_CACHE:-/tmp/repaudit-cache}
export PYTHONPATH="$PWD/kernels:$PWD${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)
step() { echo "== $(date +%T) [$(( $(date +%s) - START ))s] $1"; }
# pytest_gpu "-k expression" FILE...: the GPU tests, logged with their exit code to $OUT/pytest.log.
pytest_gpu() {
  local k=$1; shift
  timeout "${TEST_BUDGET:-240}" python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs "$@" -k "$k" \
    > "$OUT/pytest.log" 2>&1
  echo "exit $?" >> "$OUT/pytest.log"; tail -n 2 "$OUT/pytest.log"
}
# records_against_committed: the transformers engine's TP=1 tbik cells (batch 1 and 32, generate and
# score) run now, each diffed against the committed one of reports/vllm/h200x2-trainer-rollout/
# ($OUT/run, run.log, diff-<cell>.txt, diffs.log).
records_against_committed() {
  local old; old=$(mktemp -d)
  tar xJf reports/vllm/h200x2-trainer-rollout/cells.tar.xz -C "$old"
  timeout "${RUN_BUDGET:-150}" python3 -m repaudit run --model builtin:qwen3-0.6b --device cuda --engine hf --tp 1 \
    --batch-size 1,32 --kernels tbik --mode generate,score --probes default --max-new-tokens 16 --topk 5 \
    --out "$OUT/run" > "$OUT/run.log" 2>&1
  echo "exit $?" >> "$OUT/run.log"; tail -n 2 "$OUT/run.log"
  for cell in hf-tp1-bs1-default-tbik-generate hf-tp1-bs32-default-tbik-generate hf-tp1-bs32-default-tbik-score; do
    python3 -m repaudit diff "$old/cells/$cell.parquet" "$OUT/run/cells/$cell.parquet" > "$OUT/diff-$cell.txt" 2>&1
    echo "$cell: diff exit $?" | tee -a "$OUT/diffs.log"
  done
}
nvidia-smi -L > "$OUT/machine.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__)' >> "$OUT/machine.txt" 2>&1
python3 -c 'from repaudit import builtin; builtin.ensure("builtin:qwen3-0.6b")'
