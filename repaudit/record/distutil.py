"""Small collectives over JSON and digests, on whatever backend the job runs."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def broadcast_json(value: Any, src: int = 0) -> Any:
    """Broadcast a JSON-able value from src (no pickle: peers only ever parse JSON)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    dev = _device()
    if dist.get_rank() == src:
        payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(dev)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=dev)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.broadcast(size, src)
    if dist.get_rank() != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(payload, src)
    return json.loads(bytes(payload.cpu().numpy()).decode())


def rows_where_ranks_differ(digests: torch.Tensor) -> int:
    """How many logits rows (by digest) are not bit-identical on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0
    local = digests.to(_device())
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    stacked = torch.stack(gathered)
    return int((stacked != stacked[0]).any(dim=0).sum().item())
