#!/usr/bin/env bash
# GPU evidence for `repaudit run` and the kernel modes, in one call on a lent GPU machine:
# a quick smoke on the tiny model (stops here if the CUDA path is broken), then the matrix on
# builtin:qwen3-0.6b (Qwen3-0.6B shapes, bf16, random weights from a fixed seed).
#
#   OUT=dir TPS=1,2 [RESUME=cells.tar.xz] [SKIP_SMOKE=1] [TRACE=1] bash benchmarks/gpu_matrix.sh
#
# repaudit is not installed there: the checkout goes on PYTHONPATH. Writes to $OUT: gpu.log,
# summary.json, summary.md, manifest.json, report.html, report.md, cells.tar.xz.part-* (the
# records) and, with TRACE=1, benchmarks/gpu_trace.sh's trace.md.
# RESUME unpacks the records of an earlier call first: the run resumes where it stopped.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}" REPAUDIT_CACHE=/tmp/repaudit-cache
OUT="${OUT:-reports/gpu/latest}"; TPS="${TPS:-1,2}"; BUDGET="${BUDGET:-420}"
mkdir -p "$OUT" /tmp/runs
log="$OUT/gpu.log"
{ nvidia-smi -L; python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'; } > "$log" 2>&1
R=(python3 -m repaudit run --device cuda)
echo "== smoke: ${R[*]} --model builtin:tiny-qwen3 --tp $TPS --batch-size 1,3 --kernels stock,tbik --probes smoke" >> "$log"
if [ -n "${RESUME:-}" ]; then
    mkdir -p /tmp/runs/matrix && xz -dc "$RESUME" | tar -C /tmp/runs/matrix -xf - && echo "== resumed from $RESUME: $(ls /tmp/runs/matrix/cells | wc -l) records" >> "$log"
fi
if [ "${SKIP_SMOKE:-0}" != 1 ] && ! COLUMNS=160 timeout 240 "${R[@]}" --model builtin:tiny-qwen3 --tp "$TPS" --batch-size 1,3 --kernels stock,tbik \
        --probes smoke --out /tmp/runs/smoke >> "$log" 2>&1; then
    echo "== smoke failed; job logs:" >> "$log"
    tail -n 60 /tmp/runs/smoke/jobs/node0/*.log >> "$log" 2>&1
    exit 1
fi
cmd=("${R[@]}" --model builtin:qwen3-0.6b --tp "$TPS" --batch-size 1,8,32 --nccl default,tree --kernels stock,bi,tbik
     --mode generate,score --probes default --max-new-tokens 16 --topk 0 --timeout 300 --out /tmp/runs/matrix)
echo "== matrix: ${cmd[*]}" >> "$log"
COLUMNS=160 timeout "$BUDGET" "${cmd[@]}" >> "$log" 2>&1
echo "== matrix exit code $?" >> "$log"
COLUMNS=160 timeout 150 python3 -m repaudit report /tmp/runs/matrix >> "$log" 2>&1
for f in summary.json summary.md manifest.json report.html report.md; do cp /tmp/runs/matrix/$f "$OUT/" 2>/dev/null; done
grep -h "Traceback\|Error\|error" /tmp/runs/matrix/jobs/node0/*.log 2>/dev/null | sort | uniq -c | sort -rn | head -20 >> "$log"
tar -C /tmp/runs/matrix -cf - cells manifest.json | xz -T0 -3 | split -b 15M - "$OUT/cells.tar.xz.part-"
[ "${TRACE:-0}" = 1 ] && OUT="$OUT" TPS="$TPS" REPEATS=1 bash benchmarks/gpu_trace.sh
ls -la "$OUT" >> "$log"
