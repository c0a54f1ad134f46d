"""Built-in models: real architectures, random weights from a fixed seed, a local byte-level
tokenizer. Made on first use in repaudit's cache; nothing is downloaded.

`builtin:tiny-qwen3` and `builtin:tiny-llama` are a few MB and run on a laptop CPU;
`builtin:qwen3-0.6b` and `builtin:qwen3-1.7b` have Qwen3-0.6B's and Qwen3-1.7B's shapes
(untied lm_head: 0.75 B and 2.0 B parameters) for GPU evidence without a hub download.

Mixture of experts (transformers' `qwen3_moe`, every layer sparse, top-k weights renormalised):
- `builtin:tiny-qwen3-moe`: tiny-qwen3's attention (hidden 64, 16 query / 8 KV heads of 16),
  2 layers of 8 experts, top-2, expert width 32: 0.25 M parameters (1 MB), for CPU tests.
- `builtin:qwen3-moe-1.6b`: Qwen3-30B-A3B's routing (128 experts, top-8, expert width 256
  where it has 768) and head_dim 128 at hidden 1024, 12 layers, 16 query / 4 KV heads,
  vocabulary 151936: 1.58 B parameters, 0.45 B active per token (0.31 B of them embeddings).
Expert widths are multiples of 16, so tbik's 8-chunk tree cuts them into whole chunks at TP 1
and 2 alike.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InputError

PREFIX = "builtin:"
VERSION = 1  # bump when a config or the tokenizer changes: the cache key changes with it

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class BuiltinSpec:
    name: str
    family: str  # transformers model_type
    config: dict[str, Any]
    seed: int


_COMMON = {"max_position_embeddings": 16384, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}

# Every layer sparse (no dense MLP layers), top-k weights renormalised as Qwen3-MoE checkpoints do.
_MOE = {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}

BUILTINS = {
    "tiny-qwen3": BuiltinSpec(
        "tiny-qwen3", "qwen3",
        {**_COMMON, "vocab_size": 384, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
         "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 16, "initializer_range": 0.1},
        seed=1234,
    ),
    "tiny-llama": BuiltinSpec(
        "tiny-llama", "llama",
        {**_COMMON, "vocab_size": 384, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16, "initializer_range": 0.1},
        seed=4321,
    ),
    "qwen3-0.6b": BuiltinSpec(
        "qwen3-0.6b", "qwen3",
        {**_COMMON, "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
         "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "initializer_range": 0.02,
         "max_position_embeddings": 40960, "rope_theta": 1000000.0},
        seed=6,
    ),
    "qwen3-1.7b": BuiltinSpec(
        "qwen3-1.7b", "qwen3",
        {**_COMMON, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
         "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "initializer_range": 0.02,
         "max_position_embeddings": 40960, "rope_theta": 1000000.0},
        seed=17,
    ),
    "tiny-qwen3-moe": BuiltinSpec(
        "tiny-qwen3-moe", "qwen3_moe",
        {**_COMMON, "vocab_size": 384, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
         "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 16, "initializer_range": 0.1,
         **_MOE, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        seed=2718,
    ),
    "qwen3-moe-1.6b": BuiltinSpec(
        "qwen3-moe-1.6b", "qwen3_moe",
        {**_COMMON, "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 12,
         "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "initializer_range": 0.02,
         "max_position_embeddings": 40960, "rope_theta": 1000000.0,
         **_MOE, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 256},
        seed=31,
    ),
}


def is_builtin(model: str) -> bool:
    return model.startswith(PREFIX)


def spec_for(model: str) -> BuiltinSpec:
    name = model[len(PREFIX):]
    if name not in BUILTINS:
        raise InputError(f"unknown built-in model {model!r}; built-ins are " + ", ".join(PREFIX + n for n in BUILTINS))
    return BUILTINS[name]


def cache_dir() -> Path:
    root = os.environ.get("REPAUDIT_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "repaudit")
    return Path(root)


def _byte_tokenizer(eos: str):
    """A byte-level tokenizer: one id per byte (0..255), then the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps each byte to a printable char; order the vocabulary by byte value.
    mapping = _bytes_to_unicode()
    vocab = {mapping[b]: b for b in range(256)}
    assert set(vocab) == set(byte_chars)
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=eos, pad_token=eos, unk_token=None, chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 30,
    )


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable-character table, which ByteLevel uses.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def ensure(model: str) -> Path:
    """The local directory of a built-in model, made (atomically) if it is not cached yet."""
    spec = spec_for(model)
    target = cache_dir() / "models" / f"{spec.name}-v{VERSION}"
    if (target / "repaudit.json").exists():
        return target
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr stays for errors: one line each

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tokenizer = _byte_tokenizer(SPECIAL_TOKENS[0])
        cfg = AutoConfig.for_model(
            spec.family, **spec.config, eos_token_id=256, pad_token_id=256, bos_token_id=None,
        )
        gen = torch.random.fork_rng(devices=[])
        with gen:
            torch.manual_seed(spec.seed)
            model_obj = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model_obj.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        weights = sorted(tmp.glob("*.safetensors"))
        info = {"name": spec.name, "version": VERSION, "seed": spec.seed,
                "weights_sha256": hashlib.sha256("".join(_sha256_file(w) for w in weights).encode()).hexdigest()}
        (tmp / "repaudit.json").write_text(json.dumps(info, indent=2) + "\n")
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "repaudit.json").exists():  # lost a race to another process: theirs is as good
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def weights_sha256(path: Path) -> str | None:
    info = path / "repaudit.json"
    if info.exists():
        return json.loads(info.read_text()).get("weights_sha256")
    return None
