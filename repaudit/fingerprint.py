"""Environment fingerprint: the versions and hardware that decide which bits come out."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("repaudit", "torch", "triton", "transformers", "vllm", "numpy", "pyarrow")
ENV_PREFIXES = ("NCCL_", "CUBLAS_", "CUDA_", "TORCH_", "TRITON_", "OMP_", "MKL_", "VLLM_")
# Set per job by launchers; they differ run to run and decide no bits.
VOLATILE_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC", "CUDA_VISIBLE_DEVICES")


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _driver() -> str | None:
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    words = first.split()
    return next((w for w in words if w[:1].isdigit() and "." in w), first)


def environment(device: str | None = None) -> dict[str, Any]:
    """Fingerprint of this process. Imports torch only to ask it about CUDA and threads."""
    env: dict[str, Any] = {pkg: _version(pkg) for pkg in PACKAGES}
    env["python"] = sys.version.split()[0]
    env["platform"] = platform.platform()
    env["cpu"] = _cpu_model()
    env["driver"] = _driver()
    env["cuda"] = env["nccl"] = None
    env["gpus"] = []
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        env["torch_threads"] = torch.get_num_threads()
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available() and device != "cpu":
            env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            try:
                env["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
            except Exception:  # NCCL missing from this torch build
                env["nccl"] = None
    env["device"] = device
    env["vars"] = {
        k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) and not k.startswith(VOLATILE_PREFIXES)
    }
    return env


# Fields that decide bits, in the order a user should read them when two records differ.
COMPARED = ("torch", "triton", "transformers", "vllm", "cuda", "driver", "nccl", "gpus", "cpu",
            "torch_threads", "device", "python", "numpy", "repaudit", "vars")


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, a, b) for every fingerprint field that differs, most telling first."""
    out = []
    for key in COMPARED:
        if a.get(key) != b.get(key):
            if key == "vars":
                va, vb = a.get(key) or {}, b.get(key) or {}
                for name in sorted(set(va) | set(vb)):
                    if va.get(name) != vb.get(name):
                        out.append((f"env {name}", va.get(name), vb.get(name)))
            else:
                out.append((key, a.get(key), b.get(key)))
    return out
