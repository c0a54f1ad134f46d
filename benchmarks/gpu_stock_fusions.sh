#!/usr/bin/env bash
# The stock mode's fused RMSNorms (tbik's squares, torch's own mean, tbik's scaling) and rotary
# embedding (tbik.apply_rope), on one GPU: their GPU tests (the kernels against transformers' eager
# ops; stock, bi and tbik records with and without them; graph replays; stock against
# model.generate), then the engine's generate
# at batch 32 on vLLM's workload (256 random prompts of 64-512 tokens, 128 new) with the stock ops
# unfused (stock-eager) and fused, bi and tbik, then plain vLLM on the same GPU, then the tbik
# records against the committed trainer cell.
#
#   OUT=dir bash benchmarks/gpu_stock_fusions.sh      # with .carry/vllm/part-1.tar.xz carried
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_setup.sh
source benchmarks/gpu_vllm_setup.sh
export CUDA_VISIBLE_DEVICES=0
step "GPU tests: stock norm and rotary kernels, fused against eager records, graph replays"
P=(python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs)
timeout 120 "${P[@]}" tests/test_tbik_gpu.py -k "rms_norm or rope" > "$OUT/pytest.log" 2>&1
echo "exit $?" >> "$OUT/pytest.log"
timeout 200 "${P[@]}" tests/test_hf_decode.py::test_stock_graph_records_are_generate_with_a_static_cache_on_a_gpu \
  tests/test_hf_decode.py::test_fused_norms_give_the_eager_norms_records_on_a_gpu \
  tests/test_hf_decode.py::test_graph_replays_are_the_eager_static_steps_bit_for_bit >> "$OUT/pytest.log" 2>&1
echo "exit $?" >> "$OUT/pytest.log"; grep "passed\|failed\|^exit" "$OUT/pytest.log"
step "engine, vLLM's workload, generate batch 32: stock unfused and fused, bi, tbik"
timeout 220 "${speed[@]}" --kernels stock-eager,stock,bi,tbik --mode generate --batch 32 --chunks 8 --random 256 \
  --new 128 --no-baseline --json "$OUT/engine_speed_random.json" 2>&1 | grep -v Loading
step "plain vLLM, vLLM's workload, its own batching"
timeout 150 python3 benchmarks/vllm_speed.py --model "$MODEL" --tp 1 --kernels stock --prompts 256 --new 128 --runs 3 \
  --vllm-args '{}' --json "$OUT/vllm_speed.json" 2>&1 | grep -v "it/s\]" | tail -n 3
step "records: tbik TP=1 against the committed trainer cell"
records_against_committed
step done
