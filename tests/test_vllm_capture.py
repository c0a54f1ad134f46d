"""The vLLM generate cell's logprob capture: the worker-side hook after each sampling step, the
packing of its steps, and the matching of captured steps to vLLM's outputs. The hook runs here
around a stand-in sampler (vLLM needs a GPU); tests/data/vllm_capture.json holds a real run's
capture beside vLLM's own logprobs for the same requests, and the two must give the same rows."""

import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from repaudit.engines import vllm_capture, vllm_engine


def _out(request_id, prompt, tokens):
    return NS(request_id=request_id, prompt_token_ids=list(prompt), outputs=[NS(token_ids=list(tokens))])


def _captured(steps):
    """steps: (req_ids, ids rows, logprob rows, sampled) -> what repaudit_capture_end returns."""
    return vllm_capture.pack([(r, torch.tensor(i, dtype=torch.int64), torch.tensor(lp, dtype=torch.float32),
                               torch.tensor(s, dtype=torch.int32)) for r, i, lp, s in steps])


def test_captured_steps_become_each_requests_rows_in_step_order():
    # request "0": a prefill chunk that samples nothing, then 3 tokens, then one step after its stop;
    # request "1": 2 tokens. Internal ids carry vLLM's random suffix; steps interleave the requests.
    steps = [
        (["0-aaaaaaaa", "1-bbbbbbbb"], [[9, 9, 9], [20, 20, 21]], [[0.0, 0.0, 0.0], [-0.5, -0.5, -1.5]], [0, 1]),
        (["1-bbbbbbbb", "0-aaaaaaaa"], [[22, 22, 23], [10, 10, 11]], [[-0.25, -0.25, -2.0], [-0.125, -0.125, -3.0]], [1, 1]),
        (["0-aaaaaaaa"], [[12, 13, 12]], [[-1.0, -1.0, -1.0]], [1]),  # a tie at the top: ids order it
        (["0-aaaaaaaa"], [[14, 14, 15]], [[-0.0625, -0.0625, -4.0]], [1]),
        (["0-aaaaaaaa"], [[99, 99, 98]], [[-7.0, -7.0, -8.0]], [1]),  # scheduled before the stop was seen
    ]
    outs = [_out("0", [1, 2, 3], [10, 12, 14]), _out("1", [4, 5], [20, 22])]
    rows = vllm_capture.rows_from_capture(outs, _captured(steps), ["p0", "p1"], [3, 2], topk=2)
    r0, r1 = rows
    assert r0.prompt_id == "p0" and r0.pos.tolist() == [3, 4, 5] and r0.token_id.tolist() == [10, 12, 14]
    assert r0.logprob.view(np.uint32).tolist() == np.float32([-0.125, -1.0, -0.0625]).view(np.uint32).tolist()
    assert r0.topk_ids.tolist() == [[10, 11], [12, 13], [14, 15]] and r0.top1.tolist() == [10, 12, 14]
    assert r1.pos.tolist() == [2, 3] and r1.topk_logprobs.tolist() == [[-0.5, -1.5], [-0.25, -2.0]]
    assert r0.digest is None and r0.logprob.dtype == np.float32 and r0.topk_ids.dtype == np.int32


def test_a_capture_that_lost_track_of_a_request_raises():
    steps = [(["0-aaaaaaaa"], [[10, 10, 11]], [[-0.1, -0.1, -2.0]], [1])]
    with pytest.raises(RuntimeError, match="holds 1 steps that do not match the 2 generated tokens"):
        vllm_capture.rows_from_capture([_out("0", [1], [10, 12])], _captured(steps), ["p"], [1], topk=2)
    with pytest.raises(RuntimeError, match="do not match"):
        vllm_capture.rows_from_capture([_out("0", [1], [11])], _captured(steps), ["p"], [1], topk=2)
    with pytest.raises(RuntimeError, match="had 2 logits rows for 1 requests"):
        vllm_capture.rows_from_capture([_out("0", [1], [11])], {"error": "a sampling step had 2 logits rows for 1 requests"},
                                       ["p"], [1], topk=2)


@pytest.fixture
def fake_vllm_logprob(monkeypatch):
    """vllm.v1.worker.gpu.sample.logprob with a compute_token_logprobs that records its calls."""
    calls = []

    def compute_token_logprobs(logits, ids):
        calls.append(ids.clone())
        return torch.log_softmax(logits.float(), -1).gather(1, ids)

    names = ["vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu", "vllm.v1.worker.gpu.sample"]
    mods = {n: types.ModuleType(n) for n in names}
    mods["vllm.v1.worker.gpu.sample"].logprob = types.ModuleType("logprob")
    mods["vllm.v1.worker.gpu.sample"].logprob.compute_token_logprobs = compute_token_logprobs
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu.sample.logprob", mods["vllm.v1.worker.gpu.sample"].logprob)
    monkeypatch.setattr(vllm_capture, "_state", vllm_capture._Capture())
    return calls


def _worker(sampler, rank=0, v2=True, speculator=None):
    w = vllm_capture.CaptureWorker()
    w.use_v2_model_runner, w.rank = v2, rank
    w.model_runner = NS(sampler=sampler, speculator=speculator)
    return w


def test_the_hook_asks_vllms_kernel_for_the_sampled_token_and_the_top_k_and_keeps_copies(fake_vllm_logprob):
    class Sampler:  # vLLM's sampler: greedy tokens into a buffer it reuses every step
        def __init__(self):
            self.buf = torch.zeros(3, 1, dtype=torch.int64)

        def __call__(self, logits, input_batch):
            self.buf.copy_(logits.argmax(-1, keepdim=True))
            return NS(sampled_token_ids=self.buf, logprobs_tensors=None, num_sampled=torch.tensor([1, 0, 1]))

    sampler = Sampler()
    worker = _worker(sampler)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 1.0, 0.0, 0.5], [0.0, 0.0, 1.0, 4.0]])
    sampler(logits, NS(req_ids=["a", "b", "c"]))  # before begin: nothing is kept
    assert worker.repaudit_capture_begin(2) is True
    sampler(logits, NS(req_ids=["a", "b", "c"]))
    sampler(logits.flip(-1), NS(req_ids=["c", "a", "b"]))  # overwrites sampler.buf
    packed = worker.repaudit_capture_end()
    assert all(isinstance(v, (int, list, bytes)) for v in packed.values())  # what vLLM's RPC carries as is
    got = vllm_capture.unpack(packed)
    assert packed["req_ids"] == ["a", "b", "c"] and got["code"].tolist() == [0, 1, 2, 2, 0, 1]
    assert got["ids"][:3].tolist() == [[1, 1, 3], [0, 0, 1], [3, 3, 2]]  # sampled, then top-2, from step 1's buffer
    assert got["ids"][3:, 0].tolist() == [2, 3, 0] and got["sampled"].tolist() == [1, 0, 1, 1, 0, 1]
    assert "top1" not in got  # the rows take top1 from the logprobs, not from an argmax
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor([[1, 1, 3], [0, 0, 1], [3, 3, 2]]))
    assert got["logprobs"][:3].view(np.uint32).tolist() == want.numpy().view(np.uint32).tolist()
    assert [c.shape for c in fake_vllm_logprob] == [(3, 3), (3, 3)]
    assert worker.repaudit_capture_host_s() > 0  # the two steps' host time, kept past the end
    assert vllm_capture.unpack(worker.repaudit_capture_end())["code"].shape == (0,)  # end() turned the capture off and emptied it
    sampler(logits, NS(req_ids=["a", "b", "c"]))
    assert vllm_capture._state.steps == [] and worker.repaudit_capture_host_s() == 0  # the last capture had no step


def test_the_hooks_top_k_is_the_records_order_ties_by_lowest_id(fake_vllm_logprob):
    """Three tokens share the row's largest logit, and the capture's top-2 names the two lowest
    (torch.topk on a GPU may name any two): the ids are the records' own top-k, in its order."""
    class Sampler:
        def __call__(self, logits, input_batch):
            return NS(sampled_token_ids=logits.argmax(-1, keepdim=True), logprobs_tensors=None, num_sampled=None)

    worker = _worker(Sampler())
    assert worker.repaudit_capture_begin(3)
    Sampler()(torch.tensor([[0.0, 2.0, 2.0, 2.0, 1.0], [float("nan"), 5.0, -0.0, 0.0, 0.0]]),
              NS(req_ids=["a-12345678", "b-12345678"]))
    # A NaN above every number; -0.0 ties +0.0.
    assert vllm_capture.unpack(worker.repaudit_capture_end())["ids"].tolist() == [[1, 1, 2, 3], [0, 0, 1, 2]]


def test_top1_is_the_lowest_id_of_a_tie_the_top_k_left_out():
    """A capture whose top-2 names the two higher of three tied ids (one taken with torch.topk,
    as captures were): the record's top1 is still the lowest id, the sampled token, as the
    transformers engine gives it."""
    packed = _captured([(["a-12345678"], [[1, 3, 2]], [[-0.5, -0.5, -0.5]], [1])])
    out = NS(request_id="a-12345678", prompt_token_ids=[5, 6], outputs=[NS(token_ids=[1])])
    row, = vllm_capture.rows_from_capture([out], packed, ["p"], [2], topk=2)
    # the sampled token is the lowest tied id, so the list holds it too, as the transformers engine's
    assert row.top1.tolist() == [1] and row.topk_ids.tolist() == [[1, 2]]


def test_top1_is_taken_from_the_logprobs_where_two_logits_round_to_one_logprob(fake_vllm_logprob):
    """Token 9's logit is one ulp above token 7's and both round to one logprob: greedy samples 9,
    and the record's top1, the lowest id among the largest logprobs, is 7, as the transformers
    engine records it (and top1 is topk_ids[0])."""
    from repaudit.engines.row_values import row_values

    class Sampler:
        def __call__(self, logits, input_batch):
            return NS(sampled_token_ids=logits.argmax(-1, keepdim=True), logprobs_tensors=None, num_sampled=None)

    logits = torch.zeros(1, 4096)
    logits[0, 7], logits[0, 9] = 1.0, torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    lp = torch.log_softmax(logits, -1)
    assert lp[0, 7].item() == lp[0, 9].item()
    want = row_values(logits, lp, torch.tensor([9]), 2)
    worker = _worker(Sampler())
    assert worker.repaudit_capture_begin(2)
    Sampler()(logits, NS(req_ids=["a-12345678"]))
    packed = worker.repaudit_capture_end()
    out = NS(request_id="a-12345678", prompt_token_ids=[5, 6], outputs=[NS(token_ids=[9])])
    row, = vllm_capture.rows_from_capture([out], packed, ["p"], [2], topk=2)
    assert row.top1.tolist() == want["top1"].tolist() == [7]
    assert row.topk_ids.tolist() == want["topk_ids"].tolist() == [[7, 9]]
    assert row.topk_logprobs.view(np.uint32).tolist() == want["topk_lp"].numpy().view(np.uint32).tolist()
    assert row.logprob.view(np.uint32).tolist() == want["logprob"].numpy().view(np.uint32).tolist()


def test_the_hook_steps_aside_where_it_cannot_capture(fake_vllm_logprob):
    class Sampler:
        def __call__(self, logits, input_batch):
            return NS(sampled_token_ids=logits.argmax(-1, keepdim=True), logprobs_tensors=None, num_sampled=None)

    assert _worker(Sampler(), v2=False).repaudit_capture_begin(2) is False  # vLLM's first model runner
    assert _worker(Sampler(), speculator=object()).repaudit_capture_begin(2) is False  # speculative decoding
    worker = _worker(Sampler())
    assert worker.repaudit_capture_begin(2)
    Sampler()(torch.zeros(4, 5), NS(req_ids=["a", "b"]))  # verification rows: several per request
    assert worker.repaudit_capture_end() == {"error": "a sampling step had 4 logits rows for 2 requests"}
    other = _worker(Sampler(), rank=1)
    assert other.repaudit_capture_begin(2)
    Sampler()(torch.zeros(2, 5), NS(req_ids=["a", "b"]))
    assert other.repaudit_capture_end() is None and vllm_capture._state.steps == []  # only rank 0 answers


def test_vllm_runs_the_capture_extension_and_a_vllm_arg_can_replace_it():
    args = vllm_engine.engine_args(model_path="/m", tp=1, dtype="bfloat16", batch_size=8, max_len=300, topk=5)
    assert args["worker_extension_cls"] == vllm_capture.EXTENSION
    llm = NS(llm_engine=NS(vllm_config=NS(parallel_config=NS(worker_extension_cls=args["worker_extension_cls"]))))
    assert vllm_capture.installed(llm)
    llm.llm_engine.vllm_config.parallel_config.worker_extension_cls = "mine.Ext"
    assert not vllm_capture.installed(llm)


FIXTURE = Path(__file__).parent / "data" / "vllm_capture.json"


@pytest.mark.skipif(not FIXTURE.exists(), reason="recorded by benchmarks/vllm_speed.py --fixture on a GPU")
def test_a_real_capture_gives_vllms_own_logprobs_bit_for_bit():
    """The same requests on one LLM, once with vLLM's logprobs and once captured: the same rows."""
    data = json.loads(FIXTURE.read_text())
    own = [vllm_engine.rows_from_output(vllm_engine.output_from_json(o), f"p{i}", len(o["prompt_token_ids"]),
                                        data["topk"], completion=True) for i, o in enumerate(data["own"])]
    outs = [vllm_engine.output_from_json(o) for o in data["captured_outputs"]]
    for o, rid in zip(outs, data["request_ids"]):
        o.request_id = rid
    cap = data["capture"]
    captured = vllm_capture.pack_arrays(cap["req_ids"], np.asarray(cap["code"]), np.asarray(cap["ids"]),
                                        np.asarray(cap["logprob_bits"], np.uint32).view(np.float32), np.asarray(cap["sampled"]))
    got = vllm_capture.rows_from_capture(outs, captured, [f"p{i}" for i in range(len(outs))],
                                         [len(o.prompt_token_ids) for o in outs], data["topk"])
    assert sum(len(r.pos) for r in got) > 0
    for a, b in zip(own, got):
        assert a.pos.tolist() == b.pos.tolist() and a.token_id.tolist() == b.token_id.tolist()
        assert a.logprob.view(np.uint32).tolist() == b.logprob.view(np.uint32).tolist()
        assert a.topk_ids.tolist() == b.topk_ids.tolist() and a.top1.tolist() == b.top1.tolist()
        assert a.topk_logprobs.view(np.uint32).tolist() == b.topk_logprobs.view(np.uint32).tolist()


def test_the_step_clock_times_each_model_step_and_gives_the_runner_its_own_method_back(monkeypatch):
    class Runner:  # vLLM's model runner: the worker calls execute_model once a step
        def __init__(self):
            self.seen = []

        def execute_model(self, scheduler_output):
            self.seen.append(scheduler_output)
            return f"out {scheduler_output}"

    clock = iter([10.0, 10.5, 12.0, 12.25])
    monkeypatch.setattr(vllm_capture, "time", NS(perf_counter=lambda: next(clock)))
    w = vllm_capture.CaptureWorker()
    w.model_runner = Runner()
    w.repaudit_steps_begin()
    assert [w.model_runner.execute_model(s) for s in ("a", "b", "c")] == ["out a", "out b", "out c"]
    assert w.repaudit_steps_end() == [0.5, 1.5, 0.25]  # step to step, the last one to the end
    assert w.model_runner.seen == ["a", "b", "c"]
    assert "execute_model" not in vars(w.model_runner)  # the class's method again, untimed
