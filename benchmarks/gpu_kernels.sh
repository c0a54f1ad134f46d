#!/usr/bin/env bash
# One-shot GPU evidence for tbik: GPU tests at Qwen3-8B sizes, the stock-op bit probe, the
# accuracy check and the tree-matmul benchmark; logs and tables go to $OUT.
#
#   OUT=/some/dir bash benchmarks/gpu_kernels.sh [tests] [host] [bench] [probe] [accuracy] [sweep] [allreduce]
#
# With no arguments it runs tests probe accuracy bench. Meant for the lent GPU machine (where
# tbik is not installed, so kernels/ goes on PYTHONPATH); runs anywhere with CUDA. allreduce
# runs benchmarks/allreduce.py with one process per visible GPU (a P=1 run only checks the
# NCCL path; the comparison needs 2+ GPUs).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-reports/kernels/latest}"
mkdir -p "$OUT"
sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(tests probe accuracy bench)
PY="${PYTHON:-python3}"

{ nvidia-smi; "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
    > "$OUT/machine.txt" 2>&1
status=0
bench_args=()
for s in "${sections[@]}"; do
    case "$s" in
        tests)
            timeout 300 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/test_tbik_gpu.py \
                --durations=10 2>&1 | tee "$OUT/gpu_tests.log" || status=1 ;;
        probe|accuracy|bench|sweep|host) bench_args+=("$s") ;;
        allreduce) ;;  # after the single-GPU sections, below
        *) echo "unknown section $s" >&2; exit 2 ;;
    esac
done
if [ ${#bench_args[@]} -gt 0 ]; then
    "$PY" benchmarks/kernels.py "${bench_args[@]}" --out "$OUT" || status=1
fi
if [[ " ${sections[*]} " == *" allreduce "* ]]; then
    gpus=$(nvidia-smi -L | wc -l)
    timeout 300 "$PY" -m torch.distributed.run --standalone --nproc_per_node="$gpus" benchmarks/allreduce.py \
        --iters 100 --out "$OUT/allreduce.md" || status=1
fi
exit $status
