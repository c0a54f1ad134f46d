# Where a vLLM generation's GPU waits, stock against tbik at TP=2: one plain LLM.generate of 256
# prompts x 128 tokens per kernel mode, profiled with the host's ops (benchmarks/timeline.py):
# rank 0's gzipped Chrome trace, its idle gaps and the host ops around them, and each step's span
# and GPU time, in $OUT. Run from the repository root on a 2-GPU machine with OUT set.
#   OUT=dir bash benchmarks/gpu_vllm_timeline.sh
set -u
KERNELS=${KERNELS:-stock,tbik}
source benchmarks/gpu_vllm_setup.sh
step "vLLM $KERNELS TP=2: speed, profile and timeline"
timeout "${BUDGET:-480}" python3 benchmarks/vllm_speed.py --model "$MODEL" --tp 2 --kernels "$KERNELS" \
  --runs "${RUNS:-1}" --json "$OUT/vllm_speed.json" --profile "$OUT" --timeline > "$OUT/timeline-tp2.log" 2>&1
echo "exit $?" >> "$OUT/timeline-tp2.log"
# Per step (vLLM's sampler gathers the logits once a step): span, GPU time, graph replay or not,
# and the decode steps' kernels.
for k in ${KERNELS//,/ }; do
  python3 benchmarks/timeline.py "$OUT/timeline-$k-tp2-rank0.json.gz" --steps-by nccl:_all_gather_base \
    --json "$OUT/steps-$k-tp2.json" > /dev/null
done
grep -E "profile \(|timeline:|idle before|run:|== |^exit" "$OUT/timeline-tp2.log" | head -60
step done
