# Sourced by the two-lane GPU scripts (gpu_lanes.sh, gpu_engine_vs_vllm.sh) from the repository
# root with OUT set: timed step lines, the machine and versions in $OUT/machine.txt, the carried
# vLLM installed and on PYTHONPATH, MODEL (the built-in Qwen3-0.6B-shaped model's folder), `speed`
# (engine_speed.py's common arguments), graph_tests (CUDA-graph replays against eager steps),
# trace_overhead REPEATS SECONDS (benchmarks/trace_bench.py, batch 8), run_lanes (the script's
# lane0 and lane1 at the same time, logged to $OUT/lane0.log and lane1.log), speed_tp2,
# committed_trainer, rollout_tp2 and trainer_rollout_diffs.
mkdir -p "$OUT"
START=$(date +%s)
step() { echo "== $(date +%T) [$(( $(date +%s) - START ))s] $1"; }
nvidia-smi -L > "$OUT/machine.txt"
bash benchmarks/vllm_install.sh 1 > "$OUT/vllm_install.log" 2>&1
source benchmarks/vllm_env.sh
python3 -c 'import torch, triton, transformers, vllm; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__, "vllm", vllm.__version__)' >> "$OUT/machine.txt" 2>&1
MODEL=$(python3 -c 'from repaudit import builtin; print(builtin.ensure("builtin:qwen3-0.6b"))')
speed=(python3 benchmarks/engine_speed.py --model builtin:qwen3-0.6b --runs 1)

graph_tests() {
  step "pytest: graph replays vs eager steps"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_hf_decode.py -k graph \
    > "$OUT/pytest-decode.log" 2>&1; echo "exit $?" >> "$OUT/pytest-decode.log"; tail -n 2 "$OUT/pytest-decode.log"
}

trace_overhead() {
  step "tracing overhead, batch 8"
  timeout "$2" python3 benchmarks/trace_bench.py --model builtin:qwen3-0.6b --probes default --batch-size 8 \
    --repeats "$1" --json "$OUT/trace_overhead.json" 2>&1 | grep -v Loading
}

run_lanes() {
  lane0 > "$OUT/lane0.log" 2>&1 &
  lane1 > "$OUT/lane1.log" 2>&1 &
  wait
}

# trainer_rollout_diffs HF_RUN VLLM_RUN: the transformers TP=1 batch 1 tbik generate cell of HF_RUN
# against VLLM_RUN's TP=2 batch 1 and 32 cells ($OUT/diff-vllm-tp2-bs<N>.txt).
trainer_rollout_diffs() {
  for b in 1 32; do
    COLUMNS=150 timeout 20 python3 -m repaudit diff "$1/cells/hf-tp1-bs1-default-tbik-generate.parquet" \
      "$2/cells/vllm-tp2-bs$b-default-tbik-generate.parquet" > "$OUT/diff-vllm-tp2-bs$b.txt" 2>&1; echo "diff bs$b exit $?"
    head -n 10 "$OUT/diff-vllm-tp2-bs$b.txt"
  done
}

# speed_tp2 [RUNS]: vLLM stock and tbik at TP=2 side by side in one call (benchmarks/vllm_speed.py, 256
# random prompts of 64-512 tokens, 128 new, median of RUNS, default 3) into $OUT/vllm_speed.json and
# $OUT/speed-tp2.log. SPEED_BUDGET (default 420) seconds at most. INTERLEAVE=1: both modes loaded at
# once, their runs taken in turn (--interleave). VLLM_ARGS=FILE: a JSON object of engine arguments
# for both modes (--vllm-args). PROFILE=DIR: then one profiled generation per mode (--profile DIR).
speed_tp2() {
  timeout "${SPEED_BUDGET:-420}" python3 benchmarks/vllm_speed.py --model "$MODEL" --tp 2 --kernels stock,tbik \
    --runs "${1:-3}" --steps ${INTERLEAVE:+--interleave} ${PROFILE:+--profile "$PROFILE"} --vllm-args "$(if [ -n "${VLLM_ARGS:-}" ]; then cat "$VLLM_ARGS"; else echo '{}'; fi)" \
    --json "$OUT/vllm_speed.json" > "$OUT/speed-tp2.log" 2>&1
  echo "exit $?" >> "$OUT/speed-tp2.log"
  grep -E "run:|^exit" "$OUT/speed-tp2.log" | tail -n 12
}

# committed_trainer DIR: the committed transformers TP=1 tbik cells (reports/vllm/h200x2-trainer-rollout/)
# unpacked in DIR, a trainer to hold a rollout against without running one.
committed_trainer() {
  mkdir -p "$1" && tar xJf reports/vllm/h200x2-trainer-rollout/cells.tar.xz -C "$1"
}

# rollout_tp2 DIR ARGS...: vLLM at TP=2 with the tbik plugin, generate, batch 1 and 32, the default
# suite, 16 new tokens, top-5, into a fresh DIR (log: $OUT/run-vllm.log). ARGS name the model and
# anything else (--vllm-arg ...). RUN_BUDGET (default 230) seconds at most.
rollout_tp2() {
  local dir=$1; shift
  rm -rf "$dir"
  COLUMNS=150 timeout -k 5 "${RUN_BUDGET:-230}" python3 -m repaudit run --device cuda --engine vllm --tp 2 \
    --batch-size 1,32 --kernels tbik --mode generate --probes default --max-new-tokens 16 --topk 5 --timeout 150 \
    --load-timeout 200 --out "$dir" "$@" > "$OUT/run-vllm.log" 2>&1
  echo "vllm exit $?"
}
