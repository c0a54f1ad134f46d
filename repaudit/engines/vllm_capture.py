"""A generate cell's logprobs, taken inside vLLM's workers instead of through vLLM's outputs.

Asking vLLM for logprobs costs a user's generation about 30% of its tokens/s, and almost none of
that is GPU work: each step's top-k lists are copied to the host, turned into Python lists,
serialised to the engine process, handed to the driver and appended request by request. A
generate cell instead asks vLLM for no logprobs and has each worker run, after every sampling
step, what vLLM's sampler does for them (the row's top-k ids, then `compute_token_logprobs` of
the sampled token and those ids, both on the raw logits), so the values are vLLM's own bits,
computed by vLLM's own kernel (tbik's log-softmax in a tbik cell, where the plugin replaces
that kernel). The top-k ids are the records' canonical ones (row_values.top_ids), not
torch.topk's. The steps' tensors stay on the GPU and come back once, at the end, through
vLLM's collective RPC.

vLLM mixes CaptureWorker into its worker class (engine argument `worker_extension_cls`); the
capture is off until the driver turns it on for one generate call, so `LLM.generate` without
repaudit (the speed benchmark's plain runs) takes one flag test per step. It covers vLLM's
second model runner (the default) without speculative decoding; anywhere else `begin` answers
False and the cell asks vLLM for its logprobs as before (vllm_engine.generate).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np

from .base import TokenRows, topk_with_own

EXTENSION = "repaudit.engines.vllm_capture.CaptureWorker"


@dataclass
class _Capture:
    k: int | None = None  # logprobs per row while capturing, else None
    steps: list = field(default_factory=list)  # (req_ids, ids [n, 1+k], logprobs [n, 1+k], sampled [n])
    broken: str | None = None
    host_s: float = 0.0  # the host's time in the capture's part of the sampling steps


_state = _Capture()
_last_host_s = 0.0  # host_s of the last capture that ended (benchmarks/vllm_speed.py reads it)


def _sampling_with_capture(call):
    def sample(self, logits, input_batch, *args, **kwargs):
        out = call(self, logits, input_batch, *args, **kwargs)
        if _state.k is None or out.logprobs_tensors is not None:
            return out
        t0 = time.perf_counter()
        n = len(input_batch.req_ids)
        if logits.shape[0] != n:  # several logits rows per request: a verification step
            _state.broken = f"a sampling step had {logits.shape[0]} logits rows for {n} requests"
            return out
        import torch
        from vllm.v1.worker.gpu.sample import logprob

        from .row_values import top_ids

        # Copies, not views, on vLLM's stream: vLLM may overwrite its buffers in the next step.
        first = out.sampled_token_ids.view(-1, 1).to(torch.int64, copy=True)
        sampled = torch.ones_like(first[:, 0]) if out.num_sampled is None else out.num_sampled.clone()
        with _aside(logits, first):
            # vLLM's fast path in compute_topk_logprobs, but the top-k ids in the records' order
            # (row_values.top_ids: four kernels where torch.topk's radix passes were most of the
            # capture's GPU time, and ties by lowest id, where torch.topk keeps whichever it
            # meets). The logprobs are vLLM's own call (looked up now, so a tbik cell gets the
            # plugin's log-softmax).
            ids = top_ids(logits, first, _state.k or 0)
            lps = logprob.compute_token_logprobs(logits, ids)
        _state.steps.append((list(input_batch.req_ids), ids, lps, sampled))
        _state.host_s += time.perf_counter() - t0
        return out

    sample._repaudit_capture = True
    return sample


_side_streams: dict = {}


@contextlib.contextmanager
def _aside(*inputs):
    """On a GPU, the capture's kernels run on a stream of their own, after what vLLM has queued
    so far and beside its next step (the top-k of a batch of 150k-wide rows is not free); the
    inputs are kept from reuse until those kernels are done. On the CPU, in line."""
    import torch

    if not inputs[0].is_cuda:
        yield
        return
    device = inputs[0].device
    side = _side_streams.setdefault(device, torch.cuda.Stream(device))
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield
    for t in inputs:
        t.record_stream(side)


def _settle() -> None:
    for side in _side_streams.values():
        side.synchronize()


class CaptureWorker:
    """Methods vLLM adds to each of its workers (called through LLM.collective_rpc)."""

    def repaudit_capture_begin(self, k: int) -> bool:
        runner = getattr(self, "model_runner", None)
        sampler = getattr(runner, "sampler", None)
        if not getattr(self, "use_v2_model_runner", False) or sampler is None or getattr(runner, "speculator", None) is not None:
            return False
        cls = type(sampler)
        if not getattr(cls.__call__, "_repaudit_capture", False):
            cls.__call__ = _sampling_with_capture(cls.__call__)
        _state.k, _state.steps, _state.broken, _state.host_s = k, [], None, 0.0
        return True

    def repaudit_capture_end(self) -> dict | None:
        """The captured steps (rank 0; every other rank drops its copy and answers None)."""
        global _last_host_s
        _settle()
        steps, broken, _last_host_s = _state.steps, _state.broken, _state.host_s
        _state.k, _state.steps, _state.broken, _state.host_s = None, [], None, 0.0
        if getattr(self, "rank", 0) != 0:
            return None
        if broken:
            return {"error": broken}
        return pack(steps)

    def repaudit_capture_host_s(self) -> float:
        """The host's seconds in the last capture's sampling steps (the capture's Python and
        launches): what a cell adds to each step, where vLLM's step waits for the host."""
        return _last_host_s

    def repaudit_steps_begin(self) -> None:
        """Note the host's clock as each of this worker's model steps begins, until
        repaudit_steps_end (benchmarks/vllm_speed.py --steps: whether a slow generation is
        slow in every step or stalls in a few)."""
        runner = self.model_runner
        stamps = self._repaudit_stamps = []
        step = type(runner).execute_model.__get__(runner)

        def timed(*args, **kwargs):
            stamps.append(time.perf_counter())
            return step(*args, **kwargs)

        runner.execute_model = timed

    def repaudit_steps_end(self) -> list[float]:
        """The seconds between the steps begun since repaudit_steps_begin, the last one's to now."""
        del self.model_runner.execute_model  # the class's own again
        stamps = self._repaudit_stamps + [time.perf_counter()]
        return [b - a for a, b in zip(stamps, stamps[1:])]

    def repaudit_profile_begin(self, timeline: bool = False) -> None:
        """torch.profiler over this worker's CUDA kernels, CUDA-graph replays included, until
        repaudit_profile_end (benchmarks/vllm_speed.py --profile: where a step's GPU time goes);
        with `timeline`, the host's ops and runtime calls too, for the GPU's idle gaps."""
        import torch

        activities = [torch.profiler.ProfilerActivity.CUDA]
        if timeline:
            activities.append(torch.profiler.ProfilerActivity.CPU)
        self._repaudit_profiler = torch.profiler.profile(activities=activities)
        self._repaudit_profiler.__enter__()

    def repaudit_profile_end(self, trace: str | None = None) -> list[dict]:
        """This worker's kernels, most GPU time first: name, launches, total microseconds. With
        `trace` (a path with {rank} in it), the worker also writes the profile there as a Chrome
        trace: every rank's, since at TP > 1 a collective's time on one rank is mostly its wait for
        the others, which only their own timelines explain."""
        import torch

        prof, self._repaudit_profiler = self._repaudit_profiler, None
        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        if trace:
            prof.export_chrome_trace(trace.format(rank=getattr(self, "rank", 0)))
        kernels = [{"name": e.key, "count": e.count, "us": e.self_device_time_total}
                   for e in prof.key_averages() if e.self_device_time_total > 0]
        return sorted(kernels, key=lambda k: -k["us"])


def installed(llm) -> bool:
    """Whether this LLM's workers carry CaptureWorker (--vllm-arg worker_extension_cls can take it away)."""
    return llm.llm_engine.vllm_config.parallel_config.worker_extension_cls == EXTENSION


def pack(steps: list) -> dict:
    """One host copy of every step, in the plain types vLLM's RPC carries as they are (numpy
    arrays inside an RPC result would need vLLM's insecure serialisation): request ids as codes
    into `req_ids`, the arrays as raw bytes, so the float32 bits arrive as they left."""
    import torch

    codes: dict[str, int] = {}
    row_codes = [codes.setdefault(r, len(codes)) for req_ids, *_ in steps for r in req_ids]
    if not steps:
        return pack_arrays([], np.zeros(0), np.zeros((0, 1)), np.zeros((0, 1)), np.zeros(0))
    column = lambda i: torch.cat([s[i] for s in steps]).cpu().numpy()  # noqa: E731
    return pack_arrays(list(codes), np.asarray(row_codes), column(1), torch.cat([s[2] for s in steps]).float().cpu().numpy(),
                       column(3))


def pack_arrays(req_ids: list[str], code: np.ndarray, ids: np.ndarray, logprobs: np.ndarray,
                sampled: np.ndarray) -> dict:
    return {"req_ids": list(req_ids), "width": int(ids.shape[1]),
            "code": np.ascontiguousarray(code, dtype=np.int32).tobytes(),
            "ids": np.ascontiguousarray(ids, dtype=np.int64).tobytes(),
            "logprobs": np.ascontiguousarray(logprobs, dtype=np.float32).tobytes(),
            "sampled": np.ascontiguousarray(sampled, dtype=np.int32).tobytes()}


def unpack(packed: dict) -> dict[str, np.ndarray]:
    w = packed["width"]
    # A "top1" column (each row's argmax, in captures recorded before it was dropped) is not read.
    return {"code": np.frombuffer(packed["code"], np.int32), "ids": np.frombuffer(packed["ids"], np.int64).reshape(-1, w),
            "logprobs": np.frombuffer(packed["logprobs"], np.float32).reshape(-1, w),
            "sampled": np.frombuffer(packed["sampled"], np.int32)}


def _external_id(internal: str, known: set[str]) -> str:
    """vLLM's engine names a request `<the id LLM.generate gave it>-<8 random characters>`."""
    return internal if internal in known else internal.rsplit("-", 1)[0]


def rows_from_capture(outs: list, packed: dict, prompt_ids: list[str], prompt_lens: list[int],
                      topk: int) -> list[TokenRows]:
    """The generated tokens of each RequestOutput, with the logprobs its worker captured.

    A request's captured rows are its sampling steps in order; a step that sampled nothing (a
    prefill chunk short of the prompt's end) is dropped, and steps after the request's last
    token (vLLM schedules one more step before it sees a stop) are left over. The sampled ids
    must be the output's tokens, position for position, or the capture lost track: that raises."""
    if "error" in packed:
        raise RuntimeError(f"vLLM logprob capture: {packed['error']}")
    captured = unpack(packed)
    keep = captured["sampled"] > 0
    code, ids, lps = captured["code"][keep], captured["ids"][keep], captured["logprobs"][keep]
    top_ids, top_lps = topk_with_own(ids[:, 0], lps[:, 0], ids[:, 1:], lps[:, 1:])  # every row at once
    # top1 is the lowest id among the largest logprobs (two logits that differ can round to one
    # logprob), so it is taken from the candidates, the sampled token (the argmax) among them.
    top1 = top_ids[:, 0]
    order = np.argsort(code, kind="stable")
    starts = np.searchsorted(code[order], np.arange(len(packed["req_ids"]) + 1))
    known = {o.request_id for o in outs}
    where = {_external_id(r, known): order[starts[c]:starts[c + 1]] for c, r in enumerate(packed["req_ids"])}
    rows = []
    for out, pid, plen in zip(outs, prompt_ids, prompt_lens):
        token = np.asarray(out.outputs[0].token_ids, dtype=np.int64)
        at = where.get(out.request_id, np.zeros(0, np.int64))[:len(token)]
        if len(at) != len(token) or not (ids[at, 0] == token).all():
            raise RuntimeError(f"{pid}: vLLM logprob capture holds {len(at)} steps that do not match the "
                               f"{len(token)} generated tokens of request {out.request_id}")
        first = len(out.prompt_token_ids)
        rows.append(TokenRows(prompt_id=pid, prompt_len=plen, pos=np.arange(first, first + len(token), dtype=np.int32),
                              token_id=token.astype(np.int32), logprob=lps[at, 0].astype(np.float32),
                              top1=top1[at].astype(np.int32), topk_ids=top_ids[at, :topk].astype(np.int32),
                              topk_logprobs=top_lps[at, :topk].astype(np.float32), digest=None))
    return rows
