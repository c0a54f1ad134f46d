"""Security: nothing a user hands in is unpickled or executed, no shell strings, and a run
writes only under --out and repaudit's cache."""

from __future__ import annotations

import ast
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path


from repaudit import cli
from repaudit.errors import InputError
from repaudit.run.launch import Rendezvous, torchrun_command

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = [ROOT / "repaudit", ROOT / "kernels" / "tbik"]

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
UNSAFE_CALLS = {"eval", "exec", "__import__"}
SHELL_CALLS = {("os", "system"), ("os", "popen"), ("subprocess", "getoutput"), ("subprocess", "getstatusoutput")}
SUBPROCESS_CALLS = {"Popen", "run", "call", "check_call", "check_output"}


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return ""


def unsafe_patterns(source: str) -> list[str]:
    """What a package file must not contain, found in its syntax tree (docstrings and comments
    that *mention* pickle do not count)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(f"{where}: from {node.module} import")
        elif isinstance(node, ast.Call):
            name = _name(node.func)
            kw = {k.arg: k.value for k in node.keywords}
            if name in UNSAFE_CALLS:
                found.append(f"{where}: {name}()")
            if tuple(name.split(".")[-2:]) in SHELL_CALLS:
                found.append(f"{where}: {name}()")
            if isinstance(kw.get("shell"), ast.Constant) and kw["shell"].value is not False:
                found.append(f"{where}: shell=True")
            if name.split(".")[-1] == "load" and name.split(".")[0] in ("torch", "np", "numpy"):
                safe = "weights_only" if name.startswith("torch") else "allow_pickle"
                want = name.startswith("torch")  # torch: weights_only=True; numpy: allow_pickle must stay False
                if not (isinstance(kw.get(safe), ast.Constant) and kw[safe].value is want) and not (not want and safe not in kw):
                    found.append(f"{where}: {name}() without {safe}={want}")
            if name.endswith("read_pickle") or name in ("yaml.load", "yaml.unsafe_load"):
                found.append(f"{where}: {name}()")
            if isinstance(kw.get("trust_remote_code"), ast.Constant) and kw["trust_remote_code"].value is True:
                found.append(f"{where}: trust_remote_code=True")
            if name.split(".")[-1] in SUBPROCESS_CALLS and name.split(".")[0] in ("subprocess", "Popen") and node.args:
                if isinstance(node.args[0], (ast.Constant, ast.JoinedStr, ast.BinOp)):
                    found.append(f"{where}: {name}() with a command string")
    return found


def test_the_scanner_sees_what_it_looks_for():
    bad = """
import pickle
from marshal import loads
eval("1"); exec("x = 1"); os.system("ls"); subprocess.run("ls " + path, shell=True)
torch.load(f); torch.load(f, weights_only=False); np.load(f, allow_pickle=True); pd.read_pickle(f)
AutoModel.from_pretrained(p, trust_remote_code=True); subprocess.Popen(f"torchrun {spec}")
"""
    assert len(unsafe_patterns(bad)) == 13, unsafe_patterns(bad)
    good = """
model.eval(); re.compile("x"); torch.load(f, weights_only=True); np.load(f)
subprocess.Popen([sys.executable, "-m", "x", path], start_new_session=True)
AutoConfig.from_pretrained(p, trust_remote_code=trust_remote_code)
'''a docstring that says pickle, eval( and shell=True'''
"""
    assert unsafe_patterns(good) == []


def test_package_source_has_no_unpickling_eval_or_shell():
    files = [p for pkg in PACKAGES for p in sorted(pkg.rglob("*.py"))]
    assert len(files) > 20
    found = {str(p.relative_to(ROOT)): hits for p in files if (hits := unsafe_patterns(p.read_text()))}
    assert found == {}


def test_torchrun_command_is_an_argument_list():
    """User input (paths with spaces, quotes, $(...)) reaches the job as single arguments, never through a shell."""
    nasty = Path("/tmp/out dir; touch PWNED $(touch PWNED2) 'x'/jobs/spec.json")
    cmd = torchrun_command(nasty, 2, Rendezvous(), 1, nasty.parent / "log dir; rm -rf ~")
    assert isinstance(cmd, list) and all(isinstance(a, str) for a in cmd)
    assert cmd[-1] == str(nasty) and "--log-dir=" + str(nasty.parent / "log dir; rm -rf ~") in cmd


def _remote_code_model(path: Path, marker: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "evilnet", "architectures": ["EvilModel"],
        "auto_map": {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"},
    }))
    code = f"open({str(marker)!r}, 'w').write('remote code ran')\n"
    (path / "configuration_evil.py").write_text(code)
    (path / "modeling_evil.py").write_text(code)
    return path


def test_remote_code_is_refused_without_the_flag(tmp_path, capsys):
    marker = tmp_path / "PWNED"
    model = _remote_code_model(tmp_path / "evil", marker)
    rc = cli.main(["run", "--model", str(model), "--tp", "1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [
        f"repaudit: error: --model {model}: its config needs custom code from the model repository, which repaudit "
        "does not run unless you pass --trust-remote-code (inspect the code first)"]
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_trust_remote_code_is_off_by_default():
    from repaudit.run.jobspec import JobSpec
    from repaudit.run.runner import RunOptions

    assert RunOptions(out=Path("x")).trust_remote_code is False
    assert JobSpec.__dataclass_fields__["trust_remote_code"].default is False


def test_a_parquet_file_with_a_pickled_type_is_never_unpickled(tmp_path, make_record):
    """Arrow once unpickled 'arrow.py_extension_type' columns on read (CVE-2023-47248): a record
    carrying one must not run its payload through any of repaudit's readers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from repaudit.diff import diff_records
    from repaudit.records import load_frame, read_meta

    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    good = make_record("good.parquet", prompt_id=["a", "a"], pos=[0, 1], logprob=__import__("numpy").zeros(2, "float32"))
    table = pq.read_table(good)
    evil = pa.field("evil", pa.binary(), metadata={b"ARROW:extension:name": b"arrow.py_extension_type",
                                                   b"ARROW:extension:metadata": pickle.dumps(Payload())})
    table = table.append_column(evil, pa.array([b"x", b"y"]))
    path = tmp_path / "evil.parquet"
    pq.write_table(table, path)
    for read in (read_meta, load_frame, lambda p: diff_records(p, good)):
        try:
            read(path)
        except InputError:
            pass
    assert not marker.exists()


# ------------------------------------------------------------------ where a run writes

def test_a_run_writes_only_under_out_and_the_cache(tmp_path):
    """HOME, XDG_CACHE_HOME, TMPDIR and the working directory are fresh, empty temp dirs; after a
    real distributed run (TP=2, gloo) the only files anywhere under them are in --out and the
    cache. --out holds shell metacharacters: it must reach every process as one argument."""
    base = tmp_path
    dirs = {name: base / name for name in ("home", "xdg", "tmp", "cwd", "cache")}
    for d in dirs.values():
        d.mkdir()
    out = base / "out dir; touch PWNED $(touch PWNED2)"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REPAUDIT_", "TORCHINDUCTOR_", "TRITON_CACHE"))}
    env.update(HOME=str(dirs["home"]), XDG_CACHE_HOME=str(dirs["xdg"]), TMPDIR=str(dirs["tmp"]),
               REPAUDIT_CACHE=str(dirs["cache"]), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-m", "repaudit", "run", "--tp", "2", "--batch-size", "1", "--mode", "generate",
                           "--probes", "smoke", "--max-new-tokens", "4", "--out", str(out)],
                          cwd=dirs["cwd"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "cells" / "hf-tp2-bs1-default-stock-generate.parquet").is_file()
    outside = sorted(str(p.relative_to(base)) for p in base.rglob("*")
                     if not (p == out or out in p.parents or dirs["cache"] in p.parents)
                     and p not in dirs.values())
    assert outside == []  # no PWNED files either: the shell never saw the path
    assert list((out / "jobs").rglob("*.torchrun"))  # torchrun's own files are in the run directory


# ------------------------------------------------------------------ what a run records about its environment

SECRETS = {"VLLM_API_KEY": "vllm-key", "HF_TOKEN": "hf-token", "NCCL_SOCKET_PASSWORD": "nccl-pass",
           "MY_SECRET": "made-up", "CUDA_API_KEY": "cuda-key"}


def test_no_credential_reaches_any_file_of_a_run(tmp_path):
    """Credentials in the environment (some under allow-listed prefixes) never reach a record, the
    manifest, the summary, the job files or the report, in any encoding: every byte of every file
    in the run directory is searched for each value."""
    import uuid

    values = {name: f"{word}-{uuid.uuid4().hex}" for name, word in SECRETS.items()}
    env = {**os.environ, **values, "PYTHONDONTWRITEBYTECODE": "1"}
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "repaudit"]
    for args in (["run", "--tp", "1", "--batch-size", "1", "--mode", "generate", "--probes", "smoke",
                  "--max-new-tokens", "2", "--out", str(out)], ["report", str(out)]):
        proc = subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.suffix == ".parquet" for p in files) and (out / "report.html").is_file()
    leaks = {f"{p.relative_to(out)}: {name}" for p in files for name, value in values.items()
             if value.encode() in p.read_bytes()}
    assert leaks == set()
    # Said to be set where a name is on the allow-list, never with its value.
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["environment"]["vars"]["NCCL_SOCKET_PASSWORD"] == "<set>"
    assert manifest["environment"]["vars"]["CUDA_API_KEY"] == "<set>"
    assert "VLLM_API_KEY" not in manifest["environment"]["vars"]  # not a switch that changes bits


def test_fingerprint_keeps_allow_listed_switches_and_redacts_credentials():
    from repaudit.record.fingerprint import recorded_vars

    got = recorded_vars({"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "OMP_NUM_THREADS": "4",
                         "VLLM_BATCH_INVARIANT": "1", "VLLM_API_KEY": "x", "VLLM_HOST_IP": "10.0.0.1",
                         "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1", "TORCH_HOME": "/home/u", "HF_TOKEN": "x",
                         "NCCL_IB_SECRET_KEY": "x", "nccl_token": "x", "CUDA_VISIBLE_DEVICES": "0",
                         "NCCL_DEBUG": "INFO", "TORCHELASTIC_RUN_ID": "1", "NVIDIA_TF32_OVERRIDE": "0"})
    assert got == {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "OMP_NUM_THREADS": "4",
                   "VLLM_BATCH_INVARIANT": "1", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1",
                   "NCCL_IB_SECRET_KEY": "<set>", "NVIDIA_TF32_OVERRIDE": "0"}
