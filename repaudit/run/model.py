"""The model a run names, and its tokenizer and shape: resolved (built-in, local directory or Hub
id), read with one clear line when transformers cannot, and the probe suite tokenized."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import builtin
from ..errors import InputError
from ..probes import Suite
from .jobspec import PromptSpec
from .plan import ModelShape, attention_refusal

DEFAULT_MAX_NEW_TOKENS = 32


@dataclass
class ModelRef:
    id: str
    path: Path
    weights_sha256: str | None


def resolve_model(model: str) -> ModelRef:
    if builtin.is_builtin(model):
        path = builtin.ensure(model)
        return ModelRef(model, path, builtin.weights_sha256(path))
    local = Path(model).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise InputError(f"--model {model}: directory has no config.json")
        return ModelRef(str(local.resolve()), local.resolve(), _hub_weights_id(local))
    if model.count("/") != 1:
        raise InputError(f"--model {model!r}: not a local directory, not a built-in "
                         f"({', '.join(builtin.PREFIX + n for n in builtin.BUILTINS)}), and not a Hub id (org/name)")
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as exc:  # offline, unknown repo, gated repo: all end the same way for the user
        raise InputError(f"--model {model!r}: not found locally or on the Hugging Face Hub ({type(exc).__name__})") from None
    return ModelRef(model, path, _hub_weights_id(path))


def _hub_weights_id(path: Path) -> str | None:
    """Hub snapshots link each file to a blob named by its sha256: a free content hash."""
    blobs = [os.path.basename(os.path.realpath(p)) for p in sorted(path.glob("*.safetensors")) if p.is_symlink()]
    if not blobs or not all(len(b) == 64 for b in blobs):
        return None
    return hashlib.sha256("".join(blobs).encode()).hexdigest()


def _load_error(ref: ModelRef, what: str, exc: Exception) -> InputError:
    """One line, whatever transformers wrote; a refusal to run the model's own code says how to allow it."""
    if "trust_remote_code" in str(exc):
        return InputError(f"--model {ref.id}: its {what} needs custom code from the model repository, which repaudit "
                          f"does not run unless you pass --trust-remote-code (inspect the code first)")
    text = " ".join(str(exc).split())
    return InputError(f"--model {ref.id}: cannot read its {what} ({type(exc).__name__}: {text[:300]})")


def load_tokenizer(ref: ModelRef, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(ref.path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise _load_error(ref, "tokenizer", exc) from None


def stop_ids(path: str | os.PathLike, tok) -> tuple[int, ...]:
    """The token ids a generation ends at, the same for every engine: the tokenizer's EOS and
    every EOS id of the model's generation config (generation_config.json, or config.json's
    where there is none). transformers' generate() stops at the generation config's ids, and
    vLLM adds them to every request's stop ids whatever the request asks; a chat model often
    lists two (end of turn, end of text), and an engine that stopped at one only would run past
    the other and differ from the rest in length, not in numbers."""
    ids = {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()
    config = Path(path) / "generation_config.json"
    eos = None
    if config.is_file():
        eos = _json(config).get("eos_token_id")
    elif (Path(path) / "config.json").is_file():
        # Without generation_config.json, generate() (and vLLM) take the generation config from
        # config.json (GenerationConfig.from_model_config): its eos_token_id, else its decoder's.
        model = _json(Path(path) / "config.json")
        eos = model.get("eos_token_id")
        if eos is None:
            inner = next((model[k] for k in ("decoder", "generator", "text_config") if model.get(k)), None)
            eos = inner.get("eos_token_id") if isinstance(inner, dict) else None
    ids.update(int(i) for i in ([eos] if isinstance(eos, int) else eos or []) if i is not None)
    return tuple(sorted(ids))


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not readable as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: not a JSON object")
    return data


def tokenizer_meta(tok, model_id: str) -> dict[str, Any]:
    backend = getattr(tok, "backend_tokenizer", None)
    blob = (backend.to_str() if backend is not None else json.dumps(tok.get_vocab(), sort_keys=True))
    blob += str(getattr(tok, "chat_template", None))
    return {"name": model_id, "sha256": hashlib.sha256(blob.encode()).hexdigest()}


def tokenize(suite: Suite, tok, max_new_tokens: int | None, max_positions: int | None) -> list[PromptSpec]:
    out = []
    for p in suite.probes:
        if p.messages is not None:
            if not getattr(tok, "chat_template", None):
                raise InputError(f"probe {p.id!r} has 'messages' but the tokenizer has no chat template")
            ids = tok.apply_chat_template([{"role": r, "content": c} for r, c in p.messages], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
        else:
            ids = tok(p.prompt)["input_ids"]
        ids = [int(i) for i in ids]
        if len(ids) < 2:
            raise InputError(f"probe {p.id!r} tokenizes to {len(ids)} token(s); a prompt needs at least 2 to be scored")
        completion = [int(i) for i in tok(p.completion, add_special_tokens=False)["input_ids"]] if p.completion else None
        n_new = max_new_tokens or p.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        longest = len(ids) + max(n_new, len(completion or ()))
        if max_positions and longest > max_positions:
            raise InputError(f"probe {p.id!r} needs {longest} positions; the model supports {max_positions}")
        out.append(PromptSpec(id=p.id, tokens=ids, completion=completion, max_new_tokens=n_new))
    return out


def model_shape(ref: ModelRef, trust_remote_code: bool) -> tuple[ModelShape, int | None]:
    from transformers import AutoConfig

    try:
        full = AutoConfig.from_pretrained(ref.path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise _load_error(ref, "config", exc) from None
    cfg = full.get_text_config()
    styles = dict(getattr(cfg, "base_model_tp_plan", None) or {})
    try:
        from transformers import AutoModelForCausalLM

        cls = AutoModelForCausalLM._model_mapping[type(full)]
        styles.update(getattr(cls, "_tp_plan", None) or {})
    except (KeyError, AttributeError):
        pass
    heads = _layer_sizes(cfg, "num_attention_heads")
    shape = ModelShape(
        model_type=full.model_type, num_attention_heads=heads,
        num_key_value_heads=_layer_sizes(cfg, "num_key_value_heads") or heads,
        intermediate_size=_layer_sizes(cfg, "intermediate_size"), vocab_size=cfg.vocab_size, tp_styles=styles,
        attention=attention_refusal(cfg),
        moe_intermediate_size=_layer_sizes(cfg, "moe_intermediate_size"),
    )
    return shape, getattr(cfg, "max_position_embeddings", None)


def _layer_sizes(cfg, name: str) -> int | tuple[int, ...]:
    """A size of the config over every layer: one int where all layers share it (0 where the config
    has none), else the tuple of its values. Some configs hold a list per layer (Gemma 3n's
    intermediate_size), and a heterogeneous config (Gemma 4: its global-attention layers'
    num_key_value_heads) raises on a global read of a per-layer size: each layer's config says."""
    try:
        value = getattr(cfg, name, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        value = [getattr(layer, name, None) for layer in cfg.per_layer_config]
    values = tuple(dict.fromkeys(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]) if v))
    return values[0] if len(values) == 1 else values or 0
