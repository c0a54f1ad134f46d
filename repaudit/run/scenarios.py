"""Scenarios (`--scenario`): how a vLLM cell is served besides its kernels and batch.

`cold` is the plain cell (a cold prefill of every prompt, vLLM's default serving path) and the
reference of every other scenario: a scenario cell is compared with the cold cell of the same
engine, TP, batch size, NCCL preset, kernels and mode. The names and what each changes in
vLLM's engine arguments live in engines/vllm_engine.py (SCENARIO_ARGS); this module parses
them and knows which combinations cannot give a meaningful cell.
"""

from __future__ import annotations

from ..engines.vllm_engine import CHUNKED_PREFILL, SCENARIO_ARGS
from ..errors import InputError

COLD = "cold"
NAMES = (*SCENARIO_ARGS, f"{CHUNKED_PREFILL}:N")

# (scenario, kernels or mode) -> why no such cell is run. Each is a fact of vLLM 0.25.1 or of
# repaudit's plugin, not a guess: the cell would crash, or would be a cold cell under another name.
REFUSED = {
    ("fp8-kv", "tbik"): "tbik's paged attention reads the KV cache in the model's dtype, and repaudit's vLLM "
                        "plugin refuses a quantized cache",
    ("prefix-hit", "score"): "vLLM never reads the prefix cache for a request that asks for prompt logprobs "
                             "(SamplingParams.skip_reading_prefix_cache), so a score cell would be a cold prefill",
}


def parse(name: str) -> str:
    """A scenario name as given -> its canonical form ("chunked-prefill:0256" -> "chunked-prefill:256")."""
    base, colon, n = name.strip().partition(":")
    if base == CHUNKED_PREFILL and colon:
        if not n.strip().isdigit() or int(n) < 1:
            raise InputError(f"--scenario {name!r}: {CHUNKED_PREFILL}:N needs N, the prefill chunk in tokens, "
                             "a positive integer")
        return f"{CHUNKED_PREFILL}:{int(n)}"
    if colon or base not in SCENARIO_ARGS:
        raise InputError(f"--scenario {name!r}: expected names among {', '.join(NAMES)}")
    return base


def id_suffix(scenario: str) -> str:
    """The scenario's part of a cell or launch group id: nothing for cold, else "-" and the name
    without ':' ("-chunked-prefill256"), as ids name files."""
    return "" if scenario == COLD else "-" + scenario.replace(":", "")


def refusal(scenario: str, kernels: str, mode: str) -> str | None:
    """Why a cell of this scenario, kernel mode and mode is not run, or None."""
    return REFUSED.get((scenario, kernels)) or REFUSED.get((scenario, mode))
