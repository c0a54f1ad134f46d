"""NCCL presets: named sets of NCCL_* variables, applied to a launch group's processes.

NCCL reads its environment when a communicator is created, so every preset is its own job.
"""

from __future__ import annotations

from .errors import InputError

PRESETS: dict[str, dict[str, str]] = {
    "default": {},
    "ring": {"NCCL_ALGO": "Ring"},
    # Plain `Tree` also forces all-gather onto the tree algorithm, which NCCL 2.28 rejects.
    "tree": {"NCCL_ALGO": "allreduce:tree"},
    "deterministic": {
        "NCCL_ALGO": "allreduce:tree",
        "NCCL_PROTO": "Simple",
        "NCCL_MIN_NCHANNELS": "1",
        "NCCL_MAX_NCHANNELS": "1",
    },
}


def parse_custom(spec: str) -> tuple[str, dict[str, str]]:
    """'NAME:NCCL_X=a,NCCL_Y=b' -> (NAME, {...}). Only NCCL_* names are accepted."""
    name, sep, body = spec.partition(":")
    name = name.strip()
    if not sep or not name or not body.strip():
        raise InputError(f"--nccl-set {spec!r}: expected NAME:NCCL_VAR=VALUE[,NCCL_VAR=VALUE...]")
    if not name.replace("-", "").replace("_", "").isalnum():
        raise InputError(f"--nccl-set {spec!r}: preset name must be letters, digits, '-' or '_'")
    if name in PRESETS:
        raise InputError(f"--nccl-set {spec!r}: {name!r} is a built-in preset; choose another name")
    env = {}
    for item in body.split(","):
        var, eq, value = item.partition("=")
        var = var.strip()
        if not eq or not var:
            raise InputError(f"--nccl-set {spec!r}: {item!r} is not VAR=VALUE")
        if not var.startswith("NCCL_"):
            raise InputError(f"--nccl-set {spec!r}: {var!r} is not an NCCL_* variable")
        env[var] = value.strip()
    return name, env


def resolve(names: list[str], custom: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    out = {}
    for name in names:
        if name in PRESETS:
            out[name] = PRESETS[name]
        elif name in custom:
            out[name] = custom[name]
        else:
            known = ", ".join(list(PRESETS) + list(custom))
            raise InputError(f"unknown NCCL preset {name!r}; known: {known} (define more with --nccl-set NAME:NCCL_VAR=VALUE)")
    return out
