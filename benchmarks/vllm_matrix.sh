#!/usr/bin/env bash
# GPU evidence for the vLLM engine, trainer (transformers TP=1) versus rollout (vLLM TP=N), on
# the lent GPU machine, after benchmarks/vllm_install.sh has put vLLM in /tmp/vllm-site.
#
#   OUT=dir [ENGINES=hf,vllm] [TPS=1,2] [BS=1,8] [KERNELS=stock,bi,tbik] [PROBES=default] [NEW=16] [BUDGET=420] [GPU_TEST=1] \
#       bash benchmarks/vllm_matrix.sh
#
# benchmarks/vllm_env.sh puts vLLM and this checkout on PYTHONPATH. RESUME=cells.tar.xz (from an
# earlier call) resumes that run. Writes to $OUT: vllm.log, vllm_tests.log, summary.*,
# manifest.json, report.html, report.md, cells.tar.xz (records, trainer-vs-rollout diffs).
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/vllm_env.sh
OUT="${OUT:-reports/vllm/latest}"; TPS="${TPS:-1,2}"; BUDGET="${BUDGET:-420}"; BS="${BS:-1,8}"
KERNELS="${KERNELS:-stock,bi,tbik}"; PROBES="${PROBES:-default}"; NEW="${NEW:-16}"
mkdir -p "$OUT" /tmp/runs
log="$OUT/vllm.log"
{ nvidia-smi -L; python3 -c 'import torch, triton, transformers, vllm; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "vllm", vllm.__version__)'
  python3 -c 'from importlib.metadata import entry_points; print("plugins:", [e.value for e in entry_points(group="vllm.general_plugins")])'
} > "$log" 2>&1
model=$(python3 -c 'from repaudit import builtin; print(builtin.ensure("builtin:qwen3-0.6b"))' 2>>"$log")
echo "== model dir $model" >> "$log"
if [ "${GPU_TEST:-1}" = 1 ]; then
  echo "== tests: REPAUDIT_VLLM_MODEL=$model python3 -m pytest tests/test_vllm_engine.py" >> "$log"
  REPAUDIT_VLLM_MODEL="$model" timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs \
      tests/test_vllm_engine.py > "$OUT/vllm_tests.log" 2>&1
  echo "== tests exit code $?" >> "$log"
fi
RUN=${RUN:-/tmp/runs/vllm}
[ -n "${RESUME:-}" ] && mkdir -p "$RUN" && xz -dc "$RESUME" | tar -xf - -C "$RUN"
cmd=(python3 -m repaudit run --device cuda --model builtin:qwen3-0.6b --engine "${ENGINES:-hf,vllm}" --tp "$TPS" --batch-size "$BS"
     --kernels "$KERNELS" --mode generate,score --probes "$PROBES" --max-new-tokens "$NEW" --topk 5 --timeout 300
     --load-timeout 300 --reference-per engine,kernels,mode --out "$RUN")
echo "== matrix: ${cmd[*]}" >> "$log"
COLUMNS=160 timeout "$BUDGET" "${cmd[@]}" >> "$log" 2>&1
echo "== matrix exit code $?" >> "$log"
COLUMNS=160 timeout 120 python3 -m repaudit report "$RUN" >> "$log" 2>&1
# Trainer (transformers, TP=1, batch 1) versus rollout (vLLM, every TP and batch size), same
# kernel mode and mode: the score cells score the same reference tokens on both engines.
mkdir -p "$RUN/diffs"
for a in "$RUN"/cells/hf-tp1-bs1-*.parquet; do
  [ -f "$a" ] || continue
  tail=${a#"$RUN"/cells/hf-tp1-bs1-}
  for b in "$RUN"/cells/vllm-tp*-"${tail#*-}"; do
    [ -f "$b" ] || continue
    n="$(basename "${a%.parquet}")--$(basename "${b%.parquet}")"
    echo "== diff $n" >> "$log"
    COLUMNS=160 timeout 60 python3 -m repaudit diff "$a" "$b" --json "$RUN/diffs/$n.json" 2>&1 | head -n 30 >> "$log"
  done
done
for f in summary.json summary.md manifest.json report.html report.md; do cp "$RUN/$f" "$OUT/" 2>/dev/null; done
for f in "$RUN"/jobs/node0/vllm-*.log; do
    [ -f "$f" ] && { echo "== tail $f"; grep -v "^\s*$" "$f" | grep -v "it/s\]" | tail -n 25; } >> "$log"
done
tar -C "$RUN" -cf - cells diffs manifest.json 2>/dev/null | xz -T0 -3 > "$OUT/cells.tar.xz"
ls -la "$OUT" >> "$log"
