"""Token ids to text for the report: the tokenizer the run used, or token ids when it cannot be had."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence


class TokenText:
    """decode() and piece() with a fallback to ids. `note` says which one the report shows."""

    def __init__(self, tok: Any = None, note: str = "") -> None:
        self.tok = tok
        self.note = note

    @property
    def available(self) -> bool:
        return self.tok is not None

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self.tok is not None:
            try:
                return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            except Exception:  # a broken or foreign tokenizer must not break the report
                pass
        return "".join(f"⟨{i}⟩" for i in ids)

    def piece(self, token_id: int) -> str:
        """One token as text; byte-level pieces that are not whole characters show as U+FFFD."""
        return self.decode([token_id])


def load_token_text(path: str | os.PathLike | None, expected_sha256: str | None = None, model_id: str | None = None) -> TokenText:
    """The tokenizer at `path` (or, failing that, `model_id` from the local Hugging Face cache),
    checked against the records' tokenizer hash when one is given. Never raises."""
    candidates: list[tuple[str, dict[str, Any]]] = []
    if path and Path(path).is_dir():
        candidates.append((str(path), {}))
    if model_id:
        from .. import builtin

        if builtin.is_builtin(model_id):
            try:
                d = builtin.cache_dir() / "models" / f"{builtin.spec_for(model_id).name}-v{builtin.VERSION}"
            except Exception:
                d = None
            if d is not None and (d / "repaudit.json").exists() and str(d) not in (c for c, _ in candidates):
                candidates.append((str(d), {}))
        elif Path(model_id).is_dir():
            candidates.append((model_id, {}))
        elif model_id.count("/") == 1:
            snapshot = _hub_cache_dir(model_id)
            if snapshot is not None:
                candidates.append((snapshot, {}))
    if not candidates:
        return TokenText(None, f"tokenizer not found ({path or model_id or 'no model path'}): showing token ids")
    why = ""
    for where, kw in candidates:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(where, **kw)
        except Exception as exc:  # missing files, offline hub, unknown class: fall back to ids
            why = f"{type(exc).__name__}"
            continue
        if expected_sha256:
            from ..run.model import tokenizer_meta

            try:
                got = tokenizer_meta(tok, "")["sha256"]
            except Exception:
                got = None
            if got is not None and got != expected_sha256:
                why = f"the tokenizer at {where} is not the one the records were made with (sha256 {got[:12]} vs {expected_sha256[:12]})"
                continue
        return TokenText(tok, f"text decoded with the tokenizer at {where}")
    return TokenText(None, f"tokenizer could not be loaded ({why}): showing token ids")


def _hub_cache_dir(model_id: str) -> str | None:
    """The local Hugging Face cache snapshot holding this model's tokenizer, if any (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    for name in ("tokenizer.json", "tokenizer_config.json"):
        try:
            hit = try_to_load_from_cache(model_id, name)
        except Exception:  # a malformed id
            return None
        if isinstance(hit, str):
            return str(Path(hit).parent)
    return None
