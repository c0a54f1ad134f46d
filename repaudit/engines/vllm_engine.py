"""The vLLM engine (optional extra: pip install 'repaudit[vllm]')."""

from __future__ import annotations

from ..errors import InputError


def require() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise InputError("--engine vllm needs vLLM: pip install 'repaudit[vllm]'") from None
