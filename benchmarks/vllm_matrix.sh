#!/usr/bin/env bash
# GPU evidence for the vLLM engine, trainer (transformers TP=1) versus rollout (vLLM TP=N), on
# the lent GPU machine, after benchmarks/vllm_install.sh has put vLLM in /tmp/vllm-site.
#
#   OUT=dir [TPS=1,2] [BS=1,8] [KERNELS=stock,bi,tbik] [PROBES=default] [NEW=16] [BUDGET=420] [GPU_TEST=1] \
#       bash benchmarks/vllm_matrix.sh
#
# repaudit is not pip-installed there (the checkout goes on PYTHONPATH), so vLLM would not see
# its plugin entry point: a dist-info holding only that entry point is written next to vLLM,
# which is what `pip install repaudit` gives importlib.metadata. Writes to $OUT: vllm.log,
# vllm_tests.log, summary.*, manifest.json, report.html, report.md, cells.tar.xz.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SITE=/tmp/vllm-site
export PYTHONPATH="$SITE:$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}" REPAUDIT_CACHE=/tmp/repaudit-cache
OUT="${OUT:-reports/vllm/latest}"; TPS="${TPS:-1,2}"; BUDGET="${BUDGET:-420}"; BS="${BS:-1,8}"
KERNELS="${KERNELS:-stock,bi,tbik}"; PROBES="${PROBES:-default}"; NEW="${NEW:-16}"
mkdir -p "$OUT" /tmp/runs
log="$OUT/vllm.log"
ver=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
dist="$SITE/repaudit-$ver.dist-info"
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: repaudit\nVersion: %s\n' "$ver" > "$dist/METADATA"
sed -n '/^\[project.entry-points."vllm.general_plugins"\]/,/^$/p' pyproject.toml \
    | sed 's/^\[project.entry-points."\(.*\)"\]/[\1]/' > "$dist/entry_points.txt"
{ nvidia-smi -L; python3 -c 'import torch, triton, transformers, vllm; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "vllm", vllm.__version__)'
  python3 -c 'from importlib.metadata import entry_points; print("plugins:", [e.value for e in entry_points(group="vllm.general_plugins")])'
} > "$log" 2>&1
model=$(python3 -c 'from repaudit import builtin; print(builtin.ensure("builtin:qwen3-0.6b"))' 2>>"$log")
echo "== model dir $model" >> "$log"
echo "== tests: REPAUDIT_VLLM_MODEL=$model python3 -m pytest tests/test_vllm_engine.py" >> "$log"
[ "${GPU_TEST:-1}" = 1 ] || model=""
REPAUDIT_VLLM_MODEL="$model" timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs \
    tests/test_vllm_engine.py > "$OUT/vllm_tests.log" 2>&1
echo "== tests exit code $?" >> "$log"
cmd=(python3 -m repaudit run --device cuda --model builtin:qwen3-0.6b --engine hf,vllm --tp "$TPS" --batch-size "$BS"
     --kernels "$KERNELS" --mode generate,score --probes "$PROBES" --max-new-tokens "$NEW" --topk 5 --timeout 300
     --load-timeout 300 --out /tmp/runs/vllm)
echo "== matrix: ${cmd[*]}" >> "$log"
COLUMNS=160 timeout "$BUDGET" "${cmd[@]}" >> "$log" 2>&1
echo "== matrix exit code $?" >> "$log"
COLUMNS=160 timeout 120 python3 -m repaudit report /tmp/runs/vllm >> "$log" 2>&1
for f in summary.json summary.md manifest.json report.html report.md; do cp /tmp/runs/vllm/$f "$OUT/" 2>/dev/null; done
for f in /tmp/runs/vllm/jobs/node0/vllm-*.log; do
    [ -f "$f" ] && { echo "== tail $f"; grep -v "^\s*$" "$f" | tail -n 25; } >> "$log"
done
tar -C /tmp/runs/vllm -cf - cells manifest.json 2>/dev/null | xz -T0 -3 > "$OUT/cells.tar.xz"
ls -la "$OUT" >> "$log"
