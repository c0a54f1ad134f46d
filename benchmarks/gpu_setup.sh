# Sourced by GPU scripts without vLLM (gpu_score.sh, gpu_grouped_steps.sh) from the repository
# root with OUT set: the environment (NVLink multicast off, tbik on the path), timed step lines, pytest_gpu,
# the machine and versions in $OUT/machine.txt, and the built-in Qwen3-0.6B-shaped model made.
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
nvidia-smi -L > "$OUT/machine.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__)' >> "$OUT/machine.txt" 2>&1
python3 -c 'from repaudit import builtin; builtin.ensure("builtin:qwen3-0.6b")'
