# Where a vLLM step's GPU time goes, stock against tbik, and the GPU tests of the ops the tbik
# plugin runs. Run from the repository root on a 2-GPU machine with OUT set; the carried vLLM is
# installed by gpu_vllm_setup.sh.
#   1. tests/test_tbik_gpu.py (the fused ops and paged attention against the eager ops and
#      tbik.attention, bit for bit) and tests/test_hf_ops.py (a vLLM-shaped forward through the
#      plugin's ops against the transformers engine's tbik score), on GPU 0;
#   2. benchmarks/vllm_speed.py --profile at TP=2: plain LLM.generate of 256 prompts x 128
#      tokens, timed, then one run profiled in every worker (GPU time per kernel and op kind).
set -u
source benchmarks/gpu_vllm_setup.sh
step "GPU tests: tbik ops, hf_ops"
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs \
  tests/test_tbik_gpu.py tests/test_hf_ops.py > "$OUT/pytest-gpu.log" 2>&1; echo "exit $?" >> "$OUT/pytest-gpu.log"
tail -n 15 "$OUT/pytest-gpu.log"
step "vLLM stock,tbik TP=2: speed and profile"
timeout 420 python3 benchmarks/vllm_speed.py --model "$MODEL" --tp 2 --kernels stock,tbik --runs 3 \
  --json "$OUT/vllm_speed.json" --profile "$OUT" > "$OUT/speed-tp2.log" 2>&1
echo "exit $?" >> "$OUT/speed-tp2.log"
grep -E "profile \(|^\[(stock|tbik)\]   |run:|== |^exit" "$OUT/speed-tp2.log" | head -60
step done
