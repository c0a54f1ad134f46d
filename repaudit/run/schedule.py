"""Launch groups side by side on the GPUs of one node.

A group needs `tp` GPUs and has them to itself (CUDA_VISIBLE_DEVICES names them), so groups
that fit together run at the same time: on two GPUs, two TP=1 groups (a vLLM job per kernel
mode, each a minute or more of start-up) take the time of one. Groups start in plan order;
one that does not fit yet holds back those behind it, so the plan's order (the baseline's
group first) is the order in which they start. A group does not wait for the reference cell
before it starts: model loading is most of a job's time. Its score cells wait for it instead
(repaudit.run.worker._await_reference).
"""

from __future__ import annotations

import os
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Callable, Sequence, TypeVar

G = TypeVar("G")
POLL_S = 0.2


def visible_gpus(count: int) -> list[str]:
    """The GPU ids a child may name in CUDA_VISIBLE_DEVICES: the parent's own list where it has
    one (so a run confined to GPUs 2,3 stays there), else 0..count-1."""
    own = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in own.split(",") if d.strip()] if own else [str(i) for i in range(count)]
    return ids[:count]


def run_side_by_side(groups: Sequence[G], gpus: list[str], need: Callable[[G], int],
                     launch: Callable[[G, list[str]], None], stopping: Callable[[], bool]) -> None:
    """Run launch(group, its GPU ids) for every group, as many at once as the GPUs allow. Once
    `stopping()` is true no group starts; the first exception of a launch is raised when the
    running ones have ended (the caller makes `stopping()` true on it, so they end soon)."""
    free, todo = list(gpus), list(groups)
    running: dict[Future, list[str]] = {}
    error: BaseException | None = None
    with ThreadPoolExecutor(max_workers=max(1, len(gpus))) as pool:
        while running or (todo and not stopping()):
            while todo and not stopping():
                n = need(todo[0])
                if n > len(gpus):
                    raise ValueError(f"a launch group needs {n} GPUs, {len(gpus)} are visible")
                if n > len(free):
                    break
                ids, free = free[:n], free[n:]
                running[pool.submit(launch, todo.pop(0), ids)] = ids
            done, _ = wait(running, timeout=POLL_S, return_when=FIRST_COMPLETED)
            for fut in done:
                free += running.pop(fut)
                error = error or fut.exception()
    if error is not None:
        raise error
