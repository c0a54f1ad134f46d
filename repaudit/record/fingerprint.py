"""Environment fingerprint: the versions, hardware and switches that decide which bits come out.

Only variables on an allow-list are recorded (records, manifests and reports are shared), and
never the value of one whose name says it is a credential.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("repaudit", "torch", "triton", "transformers", "vllm", "numpy", "pyarrow")
# Variables that can change kernels, reduction order or thread counts: whole families by prefix...
ENV_PREFIXES = ("NCCL_", "CUBLAS_", "CUBLASLT_", "CUDA_", "OMP_", "MKL_", "KMP_")
# ...and single switches of families that mostly hold unrelated settings.
ENV_NAMES = frozenset({
    "NVIDIA_TF32_OVERRIDE", "OPENBLAS_NUM_THREADS", "TRITON_INTERPRET", "TRITON_F32_DEFAULT",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "TORCH_BLAS_PREFER_CUBLASLT", "TORCH_BLAS_PREFER_HIPBLASLT",
    "TORCH_CUDNN_V8_API_DISABLED", "TORCH_CUDNN_SDPA_ENABLED",
    "TORCHINDUCTOR_MAX_AUTOTUNE", "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM",
    "VLLM_BATCH_INVARIANT", "VLLM_ATTENTION_BACKEND", "VLLM_USE_V1", "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_FLASH_ATTN_VERSION", "VLLM_USE_TRITON_FLASH_ATTN", "VLLM_USE_FLASHINFER_SAMPLER",
    "VLLM_ALLREDUCE_USE_SYMM_MEM", "VLLM_USE_NCCL_SYMM_MEM", "VLLM_USE_DEEP_GEMM", "VLLM_FUSED_MOE_CHUNK_SIZE",
    "VLLM_DISABLE_COMPILE_CACHE", "VLLM_USE_STANDALONE_COMPILE",
})
# Allowed, but set per job by launchers or by repaudit itself; they decide no bits.
VOLATILE_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC", "CUDA_VISIBLE_DEVICES", "NCCL_DEBUG")
# A name holding one of these words may hold a credential: only that it was set is written.
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
REDACTED = "<set>"


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


def _nccl_version(torch) -> str | None:
    try:
        return ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception:  # NCCL missing from this torch build (CPU wheels)
        return None


def recorded_vars(environ: dict[str, str]) -> dict[str, str]:
    """The allow-listed variables of `environ`, credentials replaced by REDACTED."""
    out = {}
    for name, value in sorted(environ.items()):
        if not (name.startswith(ENV_PREFIXES) or name in ENV_NAMES) or name.startswith(VOLATILE_PREFIXES):
            continue
        out[name] = REDACTED if any(w in name.upper() for w in SECRET_WORDS) else value
    return out


def rank_settings(device: str | None = None) -> dict[str, Any]:
    """This process's switches that change bits without changing any version: they can differ
    from rank to rank (a library or a user script flips them), so each rank reports its own."""
    import torch

    on_gpu = device != "cpu" and torch.cuda.is_available()
    matmul = torch.backends.cuda.matmul
    blas = torch.backends.cuda.preferred_blas_library()
    return {
        "gpu": torch.cuda.get_device_name(torch.cuda.current_device()) if on_gpu else None,
        "driver": _driver(),
        "nccl": _nccl_version(torch) if on_gpu else None,
        "tf32_matmul": matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "fp16_reduced_precision_reduction": matmul.allow_fp16_reduced_precision_reduction,
        "bf16_reduced_precision_reduction": matmul.allow_bf16_reduced_precision_reduction,
        "blas_library": getattr(blas, "name", str(blas)),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "torch_threads": torch.get_num_threads(),
    }


def gather_rank_settings(device: str | None = None) -> list[dict[str, Any]]:
    """Every rank's rank_settings, in rank order (a collective: every rank calls it)."""
    import torch.distributed as dist

    mine = rank_settings(device)
    if not dist.is_initialized():
        return [mine]
    from .distutil import broadcast_json

    rank = dist.get_rank()
    return [broadcast_json(mine if r == rank else None, src=r) for r in range(dist.get_world_size())]


def environment(device: str | None = None) -> dict[str, Any]:
    """Fingerprint of this process. Imports torch only to ask it about CUDA, threads and switches."""
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
            env["nccl"] = _nccl_version(torch)
        env["ranks"] = [rank_settings(device)]  # a distributed worker replaces it with every rank's
    env["device"] = device
    env["vars"] = recorded_vars(dict(os.environ))
    return env


# Fields that decide bits, in the order a user should read them when two records differ.
COMPARED = ("torch", "triton", "transformers", "vllm", "cuda", "driver", "nccl", "gpus", "cpu",
            "torch_threads", "device", "python", "numpy", "repaudit", "vars")
# Process-wide fields that the per-rank settings repeat, rank by rank.
PER_RANK_TOO = ("driver", "nccl", "gpus", "torch_threads")


def settings(env: dict[str, Any]) -> dict[str, Any]:
    """The per-rank settings, one value each where every rank agrees, else the list by rank."""
    ranks = env.get("ranks") or []
    out = {}
    for name in dict.fromkeys(k for r in ranks for k in r):
        values = [r.get(name) for r in ranks]
        out[name] = values[0] if all(v == values[0] for v in values) else values
    return out


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, a, b) for every fingerprint field that differs, most telling first."""
    out = []
    per_rank = bool(a.get("ranks")) and bool(b.get("ranks"))
    for key in COMPARED:
        if a.get(key) == b.get(key) or (per_rank and key in PER_RANK_TOO):
            continue
        if key == "vars":
            va, vb = a.get(key) or {}, b.get(key) or {}
            out += [(f"env {name}", va.get(name), vb.get(name)) for name in sorted(set(va) | set(vb))
                    if va.get(name) != vb.get(name)]
        else:
            out.append((key, a.get(key), b.get(key)))
    if not per_rank:  # a record without them (an older one, another tool's) says nothing either way
        return out
    sa, sb = settings(a), settings(b)
    out += [(name, sa.get(name), sb.get(name)) for name in dict.fromkeys([*sa, *sb]) if sa.get(name) != sb.get(name)]
    return out
