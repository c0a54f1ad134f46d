#!/usr/bin/env bash
# vLLM at TP=2 on a model with ONE key/value head, which vLLM copies to both ranks (the plan
# accepts vLLM cells at a TP that is a multiple of the KV heads): the tbik plugin there against
# the transformers engine at TP=1, same prompts and tokens. Qwen3-0.6B's shapes with 8 layers and
# one KV head, random weights, the built-in byte tokenizer.
#   OUT=dir bash benchmarks/gpu_kv_copies.sh  (.carry/vllm/part-1.tar.xz carried, two GPUs)
set -u
cd "$(dirname "$0")/.."
source benchmarks/gpu_vllm_setup.sh
M=/tmp/repaudit-qwen3-kv1
step "model: $M"
python3 - "$M" <<'PY'
import shutil, sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from repaudit import builtin

src, dst = Path(builtin.ensure("builtin:qwen3-0.6b")), Path(sys.argv[1])
dst.mkdir(parents=True, exist_ok=True)
cfg = AutoConfig.from_pretrained(src)
cfg.num_key_value_heads, cfg.num_hidden_layers = 1, min(8, cfg.num_hidden_layers)
if getattr(cfg, "layer_types", None):
    cfg.layer_types = cfg.layer_types[:cfg.num_hidden_layers]
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(dst)
for f in src.iterdir():
    if f.is_file() and f.name.startswith(("tokenizer", "chat_template", "generation_config")):
        shutil.copy(f, dst / f.name)
print(sorted(p.name for p in dst.iterdir()))
PY
C="--model $M --device cuda --kernels tbik --mode generate --probes default --max-new-tokens 16 --topk 5"
step "trainer (GPU 0, meanwhile): transformers TP=1 batch 1, tbik; rollout: vLLM TP=2 batch 1, 32, tbik"
(COLUMNS=150 CUDA_VISIBLE_DEVICES=0 timeout -k 5 150 python3 -m repaudit run $C --engine hf --tp 1 --batch-size 1 \
   --out /tmp/k/hf > "$OUT/run-hf.log" 2>&1; echo "hf exit $?") &
# Eager (${VLLM_ARGS:-enforce_eager=true}): the copied head is the point here, not vLLM's graphs.
rollout_tp2 /tmp/k/vllm --model "$M" --vllm-arg "${VLLM_ARGS:-enforce_eager=true}"
wait
grep -v "it/s\]" "$OUT/run-vllm.log" | tail -n 6
trainer_rollout_diffs /tmp/k/hf /tmp/k/vllm
step done
