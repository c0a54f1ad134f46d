"""NCCL presets: named sets of NCCL_* variables, applied to a launch group's processes, and
what NCCL really chose for a group's all-reduces, read back from its debug output.

NCCL reads its environment when a communicator is created, so every preset is its own job.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

from ..errors import InputError

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


# ------------------------------------------------------------------ what NCCL really did
#
# A preset asks NCCL for an algorithm, protocol or channel count; NCCL may choose otherwise
# without saying so (an algorithm it cannot run for that size, fewer channels for a small
# message). Its debug output says what it chose. The line formats, from NVIDIA/nccl
# src/enqueue.cc (printed on rank 0 only, subsystem TUNING) and src/debug.cc (the prefix
# "[timestamp] host:pid:tid [cudaDev] NCCL INFO "):
#   2.24 - 2.30: "%s: %ld Bytes -> Algo %s proto %s channel{Lo..Hi}={%d..%d}"
#                e.g. "AllReduce: 4194304 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..7}"
#                (forks append fields such as " comm %p": the rest of a line is ignored)
#   2.23:        "%s: %ld Bytes -> Algo %d proto %d time %f"  (algorithm and protocol as numbers)
#   2.20 - 2.22: "%ld Bytes -> Algo %d proto %d time %f"  (no collective named: it belongs to the
#                collective that the same thread announced just before, subsystem COLL:
#                "%s: opCount %lx sendbuff %p recvbuff %p count %zu datatype %d op %d root %d comm %p ...")
# NCCL before 2.20 prints no tuning line: nothing is observed there.

# Index = NCCL_ALGO_* / NCCL_PROTO_* (src/include/nccl_common.h); names as NCCL_ALGO spells them, upper case.
ALGORITHMS = ("TREE", "RING", "COLLNETDIRECT", "COLLNETCHAIN", "NVLS", "NVLSTREE", "PAT")
PROTOCOLS = ("LL", "LL128", "SIMPLE")
_PREFIX = r"(?:(?P<thread>\S+:\d+:\d+) )?\[\d+\] NCCL INFO "
_TUNED = re.compile(_PREFIX + r"(?:(?P<func>\w+): )?\d+ Bytes -> Algo (?P<algo>\w+) proto (?P<proto>\w+)"
                    r"(?: channel\{Lo\.\.Hi\}=\{(?P<lo>\d+)\.\.(?P<hi>\d+)\})?")
_CALLED = re.compile(_PREFIX + r"(?P<func>\w+): opCount ")


def debug_env(nccl_version: tuple[int, ...] | None) -> dict[str, str]:
    """The variables that make NCCL print its choice per collective. Before 2.23 the tuning line
    names no collective, so the COLL lines (one per call, every rank) are needed to attribute it."""
    subsys = "TUNING" if nccl_version is not None and nccl_version >= (2, 23) else "TUNING,COLL"
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": subsys}


def _name(value: str, names: tuple[str, ...]) -> str:
    """An algorithm or protocol as the log gives it (a name, or the index before 2.24), normalised."""
    if value.isdigit():
        return names[int(value)] if int(value) < len(names) else f"#{value}"
    return value.upper().replace("_", "")


def observe(lines) -> dict[str, Any]:
    """What NCCL chose for the all-reduces in these log lines: counts per algorithm and protocol,
    the channel counts seen (where the format prints them). Lines of other formats are ignored."""
    algos, protos, channels = Counter(), Counter(), set()
    last_call: dict[str, str] = {}  # thread -> collective it announced last
    for line in lines:
        if "NCCL INFO" not in line:  # most of a job's log: skipped before any regex
            continue
        called = _CALLED.search(line)
        if called:
            last_call[called["thread"]] = called["func"]
            continue
        tuned = _TUNED.search(line)
        if not tuned or (tuned["func"] or last_call.get(tuned["thread"])) != "AllReduce":
            continue
        algos[_name(tuned["algo"], ALGORITHMS)] += 1
        protos[_name(tuned["proto"], PROTOCOLS)] += 1
        if tuned["lo"] is not None:
            channels.add(int(tuned["hi"]) - int(tuned["lo"]) + 1)
    return {"allreduces": sum(algos.values()), "algorithms": dict(algos), "protocols": dict(protos),
            "channels": sorted(channels)}


def _allowed(spec: str | None, names: tuple[str, ...]) -> set[str] | None:
    """What NCCL_ALGO / NCCL_PROTO allow for all-reduce, in NCCL's own syntax ("Ring", "^LL128",
    "ring;allreduce:tree": the last entry that applies wins; parseList in src/graph/tuning.cc).
    None = no restriction."""
    if not spec:
        return None
    allowed = None
    for entry in spec.split(";"):
        prefix, sep, body = entry.partition(":")
        if sep and prefix.strip().lower() != "allreduce":
            continue
        body = body if sep else prefix
        negate = body.strip().startswith("^")
        listed = {_name(x.strip(), names) for x in body.strip().lstrip("^").split(",") if x.strip()}
        allowed = set(names) - listed if negate else listed
    return allowed


def mismatches(observed: dict[str, Any], preset: dict[str, str]) -> list[str]:
    """Where what NCCL did differs from what the preset asked, in words; empty when it obeyed."""
    out = []
    for var, names, seen in (("NCCL_ALGO", ALGORITHMS, observed["algorithms"]),
                             ("NCCL_PROTO", PROTOCOLS, observed["protocols"])):
        allowed = _allowed(preset.get(var), names)
        other = {k: n for k, n in seen.items() if allowed is not None and k not in allowed}
        if other:
            used = ", ".join(f"{k} ({n})" for k, n in sorted(other.items()))
            out.append(f"{var}={preset[var]} asked, but NCCL used {used} for all-reduces")
    top = preset.get("NCCL_MAX_NCHANNELS")
    # Fewer channels than NCCL_MIN_NCHANNELS is NCCL's normal choice for small messages, not a refusal.
    if top and top.isdigit() and any(c > int(top) for c in observed["channels"]):
        out.append(f"NCCL_MAX_NCHANNELS={top} asked, but NCCL used {max(observed['channels'])} channels for all-reduces")
    return out


def _lines(logs: list[Path]):
    """The logs' lines, streamed (a long GPU job's log holds a line per collective)."""
    for path in logs:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield from f
        except OSError:
            continue  # a log that is gone is one observation fewer, not a failed run


def group_observation(logs: list[Path], preset: dict[str, str]) -> dict[str, Any]:
    """The manifest's view of one launch group: NCCL's choices, or "not observed", and the warnings."""
    seen = observe(_lines(logs))
    if not seen["allreduces"]:
        return {"status": "not observed", "warnings": []}
    return {"status": "observed", **seen, "warnings": mismatches(seen, preset)}


def torch_nccl_version() -> tuple[int, ...] | None:
    """The NCCL version torch was built with; None where it has none (CPU wheels)."""
    try:
        import torch

        version = torch.cuda.nccl.version()
    except Exception:  # no NCCL in this build: torch raises AttributeError or RuntimeError
        return None
    if isinstance(version, int):  # older torch: NCCL_VERSION_CODE, major*10000 + minor*100 + patch
        return (version // 10000, version // 100 % 100, version % 100)
    return tuple(int(x) for x in version[:3])
