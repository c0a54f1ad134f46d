#!/usr/bin/env bash
# GPU evidence for vLLM scenarios (docs/vllm.md, "Scenarios"): on one GPU, every scenario of a
# vLLM cell against its cold twin, stock and bi kernels, after benchmarks/vllm_install.sh has put
# vLLM in /tmp/vllm-site.
#
#   OUT=dir [SCENARIOS=cold,prefix-hit,chunked-prefill:256,eager,fp8-kv,spec-ngram] [KERNELS=stock,bi] \
#       [BS=8] [PROBES=default] [NEW=16] [BUDGET=540] [RESUME=cells.tar.xz] bash benchmarks/gpu_scenarios.sh
#
# Duration: one vLLM load per (kernel mode, scenario), 60-90 s each with torch.compile and CUDA
# graphs (eager loads faster), so 12 loads and their cells take about 15-20 minutes: more than one
# 10-minute call. The run stops at BUDGET seconds keeping every completed cell; call again with
# RESUME=$OUT/cells.tar.xz (the same command resumes) until the summary has no pending cell.
# Writes to $OUT: scenarios.log, summary.txt (the terminal summary), summary.json, summary.md,
# manifest.json, report.html, report.md, gate.txt, cells.tar.xz.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/vllm_env.sh
OUT="${OUT:-reports/vllm/scenarios}"; BUDGET="${BUDGET:-540}"; BS="${BS:-8}"; KERNELS="${KERNELS:-stock,bi}"
SCENARIOS="${SCENARIOS:-cold,prefix-hit,chunked-prefill:256,eager,fp8-kv,spec-ngram}"
PROBES="${PROBES:-default}"; NEW="${NEW:-16}"
mkdir -p "$OUT" /tmp/runs
log="$OUT/scenarios.log"
{ nvidia-smi -L; python3 -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'; } > "$log" 2>&1
RUN=${RUN:-/tmp/runs/scenarios}
if [ -n "${RESUME:-}" ]; then
    mkdir -p "$RUN" && xz -dc "$RESUME" | tar -xf - -C "$RUN" && echo "== resumed from $RESUME: $(ls "$RUN"/cells | wc -l) records" >> "$log"
fi
cmd=(python3 -m repaudit run --engine vllm --device cuda --model builtin:qwen3-0.6b --tp 1 --batch-size "$BS"
     --kernels "$KERNELS" --mode generate,score --scenario "$SCENARIOS" --probes "$PROBES" --max-new-tokens "$NEW"
     --topk 5 --timeout 300 --load-timeout 300 --out "$RUN")
echo "== matrix: ${cmd[*]}" >> "$log"
COLUMNS=160 timeout "$BUDGET" "${cmd[@]}" > "$OUT/run.txt" 2>&1
echo "== matrix exit code $?" >> "$log"
# The terminal summary (tables per kernel mode and scenario, then the price lines) is the run's last part.
sed -n '/each cell vs its reference/,$p' "$OUT/run.txt" > "$OUT/summary.txt"
COLUMNS=160 timeout 60 python3 -m repaudit gate "$RUN" > "$OUT/gate.txt" 2>&1
COLUMNS=160 timeout 120 python3 -m repaudit report "$RUN" >> "$log" 2>&1
for f in summary.json summary.md manifest.json report.html report.md; do cp "$RUN/$f" "$OUT/" 2>/dev/null; done
for f in "$RUN"/jobs/node0/vllm-*.log; do
    [ -f "$f" ] && { echo "== tail $f"; grep -v "^\s*$" "$f" | grep -v "it/s\]" | tail -n 25; } >> "$log"
done
tar -C "$RUN" -cf - cells manifest.json 2>/dev/null | xz -T0 -3 > "$OUT/cells.tar.xz"
ls -la "$OUT" >> "$log"
