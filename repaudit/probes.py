"""Probe suites: JSONL files of prompts, shipped in probes/ or given as a path."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from .errors import InputError

_KEYS = {"id", "prompt", "messages", "completion", "max_new_tokens"}


@dataclass(frozen=True)
class Probe:
    id: str
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    completion: str | None = None
    max_new_tokens: int | None = None


@dataclass(frozen=True)
class Suite:
    name: str
    path: Path
    sha256: str
    probes: tuple[Probe, ...]

    @property
    def meta(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256}


def _suite_dir() -> Path:
    # A source checkout (editable install) keeps the suites in ../probes; a wheel ships them as package data.
    here = Path(__file__).resolve().parent.parent / "probes"
    if here.is_dir():
        return here
    return Path(str(resources.files("repaudit.probe_suites")))


def builtin_suites() -> list[str]:
    return sorted(p.stem for p in _suite_dir().glob("*.jsonl"))


# JSONL lines end at \n (\r\n and a lone \r read the same: neither may appear raw inside a JSON
# string). str.splitlines also splits at U+2028, U+2029 and U+0085, which JSON strings may hold
# raw (json.dumps(..., ensure_ascii=False) writes them so): a prompt with one would be cut in two.
_LINE_END = re.compile(r"\r\n|\r|\n")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        # json.loads keeps the last of a repeated key without a word: {"id": "a", "id": "b"} would be b.
        raise ValueError(f"repeated key(s) {dup} in one object")
    return dict(pairs)


def _utf8(where: str, obj: Any) -> None:
    # JSON's \ud800 escape gives a lone surrogate, which no tokenizer takes and Parquet cannot
    # store: refused here, not as a traceback at tokenizing or as a lost cell at writing its record.
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            raise InputError(f"{where}: a string holds a lone UTF-16 surrogate ({obj[:40]!r}), not text") from None
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _utf8(where, k)
            _utf8(where, v)
    elif isinstance(obj, list):
        for v in obj:
            _utf8(where, v)


def _parse_line(where: str, obj: Any) -> Probe:
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object")
    unknown = set(obj) - _KEYS
    if unknown:
        raise InputError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_KEYS)}")
    pid = obj.get("id")
    if not isinstance(pid, str) or not pid.strip():
        raise InputError(f"{where}: 'id' must be a non-empty string")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise InputError(f"{where}: give exactly one of 'prompt' or 'messages'")
    messages = None
    if has_prompt and (not isinstance(obj["prompt"], str) or not obj["prompt"]):
        raise InputError(f"{where}: 'prompt' must be a non-empty string")
    if has_messages:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        ):
            raise InputError(f"{where}: 'messages' must be a non-empty list of {{'role': str, 'content': str}}")
        messages = tuple((m["role"], m["content"]) for m in msgs)
    completion = obj.get("completion")
    if completion is not None and (not isinstance(completion, str) or not completion):
        raise InputError(f"{where}: 'completion' must be a non-empty string")
    mnt = obj.get("max_new_tokens")
    if mnt is not None and (not isinstance(mnt, int) or isinstance(mnt, bool) or mnt < 1):
        raise InputError(f"{where}: 'max_new_tokens' must be a positive integer")
    return Probe(id=pid, prompt=obj.get("prompt"), messages=messages, completion=completion, max_new_tokens=mnt)


def load_suite(name_or_path: str) -> Suite:
    """A built-in suite by name, or a JSONL file by path. Every problem names its line."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        candidate = _suite_dir() / f"{name_or_path}.jsonl"
        if not candidate.exists():
            raise InputError(f"unknown probe suite {name_or_path!r}; built-in suites: {', '.join(builtin_suites())}, or give a path to a .jsonl file")
        path = candidate
    if path.is_dir():
        raise InputError(f"{path}: a directory, not a probe suite (a .jsonl file)")
    if not path.exists():
        raise InputError(f"{path}: probe suite file not found")
    raw = path.read_bytes()  # not only a regular file: a pipe (--probes <(...)) is read as well
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    probes: list[Probe] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(_LINE_END.split(text), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        except ValueError as exc:
            raise InputError(f"{where}: invalid JSON ({exc})") from None
        except RecursionError:
            raise InputError(f"{where}: invalid JSON (nested too deeply)") from None
        _utf8(where, obj)
        probe = _parse_line(where, obj)
        if probe.id in seen:
            raise InputError(f"{where}: duplicate prompt id {probe.id!r} (first on line {seen[probe.id]})")
        seen[probe.id] = lineno
        probes.append(probe)
    if not probes:
        raise InputError(f"{path}: probe suite has no prompts (the file is empty or blank; a suite is JSONL, one prompt per line)")
    return Suite(name=path.stem, path=path, sha256=hashlib.sha256(raw).hexdigest(), probes=tuple(probes))
