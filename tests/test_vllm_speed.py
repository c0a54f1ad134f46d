"""benchmarks/vllm_speed.py's parent: the modes' processes one after the other or loaded at once
with their runs taken in turn, the rows gathered with their ratios to stock. The children here
are stand-ins that speak the same lines (vLLM needs a GPU)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("vllm_speed", ROOT / "benchmarks" / "vllm_speed.py")
vllm_speed = importlib.util.module_from_spec(spec)
sys.modules["vllm_speed"] = vllm_speed  # its dataclass looks its module up
spec.loader.exec_module(vllm_speed)

# A mode's process: --one prints its row; --serve says READY, answers each "run" with RAN and
# "finish" with its row. Every run is logged to LOG; a mode named "broken" ends before READY.
CHILD = r'''
import json, sys
role, kernels, log, util = sys.argv[1:5]
if kernels == "broken":
    print("vLLM failed to start", flush=True)
    sys.exit(1)
tok = {"stock": 100.0, "tbik": 80.0}[kernels]
def row(runs):
    return "ROW " + json.dumps({"kernels": kernels, "plain_tok_s": tok, "repaudit_tok_s": tok * 0.9, "runs": runs,
                                "gpu_memory_utilization": util})
if role == "--one":
    with open(log, "a") as f:
        f.write(f"{kernels} one\n")
    print("some vLLM log line", flush=True)
    print(row(3), flush=True)
    sys.exit(0)
print("loading", flush=True)
print("READY", flush=True)
runs = 0
for line in sys.stdin:
    if line.strip() == "run":
        runs += 1
        with open(log, "a") as f:
            f.write(f"{kernels} run {runs}\n")
        print("a progress bar 10.0it/s]", flush=True)
        print("RAN", flush=True)
    elif line.strip() == "finish":
        print(row(runs), flush=True)
        break
'''


@pytest.fixture
def run_speed(tmp_path, monkeypatch):
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    log = tmp_path / "runs.log"
    real = vllm_speed.child_cmd

    def cmd(args, kernels, role):
        argv = real(args, kernels, role)  # the stand-in gets the memory share the real child would
        util = json.loads(argv[argv.index("--vllm-args") + 1]).get("gpu_memory_utilization")
        return [sys.executable, str(child), role, kernels, str(log), str(util)]

    monkeypatch.setattr(vllm_speed, "child_cmd", cmd)

    def run(*argv):
        out = tmp_path / "rows.json"
        monkeypatch.setattr(sys, "argv", ["vllm_speed.py", "--model", "m", "--runs", "3", "--json", str(out), *argv])
        vllm_speed.main()
        return json.loads(out.read_text()), log.read_text().splitlines()

    return run


def test_interleaved_modes_take_their_runs_in_turn_and_each_row_gets_its_ratio_to_stock(run_speed, capsys):
    rows, runs = run_speed("--kernels", "stock,tbik", "--interleave")
    assert runs == ["stock run 1", "tbik run 1", "stock run 2", "tbik run 2", "stock run 3", "tbik run 3"]
    assert [r["kernels"] for r in rows] == ["stock", "tbik"]
    assert all(r["runs"] == 3 and r["interleaved"] for r in rows)
    assert rows[0]["gpu_memory_utilization"] == "0.45"  # each of the two modes' vLLM gets half of vLLM's share
    tbik = rows[1]
    assert (tbik["plain_ratio_vs_stock"], tbik["ratio_vs_stock"]) == (0.8, 0.72)
    out = capsys.readouterr().out
    assert "[stock] loading" in out and "it/s]" not in out  # the children's logs pass through, progress bars left out


def test_one_after_the_other_each_mode_runs_alone(run_speed):
    rows, runs = run_speed("--kernels", "stock,tbik")
    assert runs == ["stock one", "tbik one"]
    assert [r["kernels"] for r in rows] == ["stock", "tbik"] and "interleaved" not in rows[0]
    assert rows[0]["gpu_memory_utilization"] == "None"  # vLLM's own default when the modes run alone
    assert rows[1]["plain_ratio_vs_stock"] == 0.8


def test_a_mode_that_does_not_start_is_reported_and_the_others_still_run(run_speed, capsys):
    rows, runs = run_speed("--kernels", "stock,broken,tbik", "--interleave")
    assert [r["kernels"] for r in rows] == ["stock", "tbik"]
    assert runs == ["stock run 1", "tbik run 1", "stock run 2", "tbik run 2", "stock run 3", "tbik run 3"]
    assert rows[0]["gpu_memory_utilization"] == "0.3"  # three modes were to share the GPUs
    assert "== broken failed" in capsys.readouterr().out


def test_terminating_the_script_ends_every_modes_processes(tmp_path):
    # A stand-in mode that says READY, starts a grandchild (as vLLM starts its engine and
    # workers) and then hangs: `timeout` stopping the script must not leave either running.
    (tmp_path / "child.py").write_text(
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(tmp_path / 'pids')!r}, 'a').write(f'{{p.pid}}\\n')\n"
        "print('READY', flush=True)\n"
        "time.sleep(300)\n")
    (tmp_path / "driver.py").write_text(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('vllm_speed', {str(ROOT / 'benchmarks' / 'vllm_speed.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['vllm_speed'] = m; spec.loader.exec_module(m)\n"
        f"m.child_cmd = lambda args, k, role: [sys.executable, {str(tmp_path / 'child.py')!r}]\n"
        "sys.argv = ['vllm_speed.py', '--model', 'm', '--kernels', 'stock,tbik', '--interleave']\n"
        "m.main()\n")
    import os
    import signal
    import subprocess
    import time

    parent = subprocess.Popen([sys.executable, str(tmp_path / "driver.py")], stdout=subprocess.DEVNULL)
    pids = tmp_path / "pids"
    deadline = time.monotonic() + 30
    while not (pids.exists() and len(pids.read_text().split()) == 2) and time.monotonic() < deadline:
        time.sleep(0.05)  # both modes started (the second only once the first said READY)
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=30) == 143
    pids = [int(p) for p in pids.read_text().split()]
    deadline = time.monotonic() + 10
    while any(map(_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)  # SIGKILL is delivered, not waited for
    assert [p for p in pids if _running(p)] == []


def _running(pid: int) -> bool:
    """Whether a process exists and is not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_modes_runs_make_its_row(monkeypatch):
    # The child's bookkeeping around a stand-in LLM: each run's plain, logprobs and cell in order,
    # the step clock around the plain runs, the cell compared with the last logprob run and the
    # last two logprob runs with each other.
    import types
    from types import SimpleNamespace as NS

    from repaudit.engines import vllm_engine

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kw: NS(**kw)))
    ticks = iter(range(1000))
    monkeypatch.setattr(vllm_speed, "time", NS(perf_counter=lambda: float(next(ticks))))

    class LLM:
        def __init__(self):
            self.calls, self.logprob_outs = [], []

        def generate(self, requests, params, use_tqdm):
            outs = [NS(outputs=[NS(token_ids=[1, 2])]) for _ in requests]
            self.calls.append(params.max_tokens if isinstance(params, NS) else params)
            if params == "logprobs":
                self.logprob_outs.append(outs)
            return outs

        def collective_rpc(self, method):
            self.calls.append(method)
            return [[0.5, 0.25]] if method == "repaudit_steps_end" else [0.125]

    llm = LLM()
    monkeypatch.setattr(vllm_engine, "generate", lambda llm, seqs, topk, stop_ids: (f"cell rows {len(llm.calls)}", None))
    monkeypatch.setattr(vllm_speed, "_generated", lambda rows: 4)
    monkeypatch.setattr(vllm_speed, "_rows", lambda outs, seqs, topk: id(outs))
    compared = []
    monkeypatch.setattr(vllm_speed, "_same_rows", lambda a, b: compared.append((a, b)) or 1.0)
    monkeypatch.setattr(vllm_speed, "_device_name", lambda tp: "gpu")
    args = NS(steps=True, no_collect=True, topk=5, tp=2, kernels="tbik", prompts=2, new=2, vllm_args="{}",
              profile=None, fixture=None)
    b = vllm_speed.Bench(llm=llm, prompts=[[1], [2]], seqs=[], requests=[{}, {}], plain_params=NS(max_tokens=2),
                         lp_params="logprobs", clock={"s": 0.0})
    for _ in range(2):
        vllm_speed.run_once(b, args)
    row = vllm_speed.finish(b, args)
    one_run = ["repaudit_steps_begin", 2, "repaudit_steps_end", "logprobs", "repaudit_capture_host_s"]
    assert llm.calls[:10] == one_run * 2
    assert llm.calls[10:] == [1, 1, 1]  # then the prompts alone, three times
    assert row["plain_step_s"] == [[0.5, 0.25], [0.5, 0.25]]
    assert row["capture_host_s"] == [0.125, 0.125]
    first, last = (id(o) for o in llm.logprob_outs)
    assert compared == [("cell rows 9", last), (first, last)]
    assert row["plain_runs_s"] == row["repaudit_runs_s"] == [1.0, 1.0]  # each run one tick of the stand-in clock
    assert row["plain_tok_s"] == 4.0 and row["ratio"] == 1.0 and row["prefill_only_s"] == 1.0
    assert row["main_gc_s"] == {"plain": [0.0, 0.0], "plain_logprobs": [0.0, 0.0], "cell": [0.0, 0.0]}
