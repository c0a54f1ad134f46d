"""Fault injection for the reliability tests: REPAUDIT_FAULT=KIND:CELL_ID[:RANK].

KIND is kill (SIGKILL this rank), hang (this rank stops; its peers block in the next
collective), oom (raise torch.OutOfMemoryError) or raise (a RuntimeError). Without RANK the
fault hits every rank. The variable is read by workers only; nothing sets it but a test.
"""

from __future__ import annotations

import os
import signal
import time


def maybe_inject(cell_id: str, rank: int) -> None:
    spec = os.environ.get("REPAUDIT_FAULT")
    if not spec:
        return
    kind, _, rest = spec.partition(":")
    target, _, on_rank = rest.partition(":")
    if target != cell_id or (on_rank and int(on_rank) != rank):
        return
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "hang":
        while True:
            time.sleep(3600)
    elif kind == "oom":
        import torch

        raise torch.OutOfMemoryError(f"injected out-of-memory in {cell_id}")
    elif kind == "raise":
        raise RuntimeError(f"injected failure in {cell_id}")
