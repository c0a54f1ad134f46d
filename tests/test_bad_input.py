"""Bad input to `repaudit run`, through the command line: each is one line on stderr and exit 2,
before any model is loaded or any job started.

tests/test_plan.py checks the same refusals function by function; here the contract is the
whole command's: the exit code, a single stderr line, no run directory, and speed.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from repaudit import cli
from repaudit.run import runner as run_mod
from repaudit.errors import InputError
from repaudit.run.plan import Matrix, ModelShape, expand, validate_against_model

RUN = ["run", "--model", "builtin:tiny-qwen3", "--probes", "smoke", "--max-new-tokens", "4", "--kernels", "stock"]


@pytest.fixture(scope="module", autouse=True)
def _warm():
    """Imports and the built-in model's files, made once: what is timed below is the validation."""
    import transformers  # noqa: F401 (imported here so it is not timed below)

    from repaudit import builtin

    builtin.ensure("builtin:tiny-qwen3")


@pytest.fixture
def refuse(tmp_path, capsys, monkeypatch):
    """refuse(*args) -> the one stderr line of `repaudit run ... --out TMP` that must fail with exit 2."""
    import huggingface_hub.constants
    import transformers

    def must_not_run(*a, **kw):
        raise AssertionError("a job or a model load was started for bad input")

    monkeypatch.setattr(run_mod, "run_group", must_not_run)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", must_not_run)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # never reach the network from a test

    def call(*args: str, base: list[str] = RUN) -> str:
        out = tmp_path / "out"
        capsys.readouterr()
        t0 = time.monotonic()
        rc = cli.main([*base, *args, "--out", str(out)])
        seconds = time.monotonic() - t0
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2, err
        assert len(err) == 1, err
        assert err[0].startswith("repaudit: error: ")
        assert not out.exists()  # no run directory, so no job directory and no manifest
        assert seconds < 10, f"refusing took {seconds:.1f}s"
        return err[0][len("repaudit: error: "):]

    return call


def _suite(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "suite.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_malformed_probe_file_names_the_line(refuse, tmp_path):
    path = _suite(tmp_path, '{"id": "a", "prompt": "x"}', '{"id": "b", "prompt": "y"', '{"id": "c", "prompt": "z"}')
    assert refuse("--probes", path) == f"{path}:2: invalid JSON (Expecting ',' delimiter at column 26)"


def test_probe_line_with_wrong_fields_names_the_line(refuse, tmp_path):
    path = _suite(tmp_path, '{"id": "a", "prompt": "x"}', '{"id": "b"}')
    assert refuse("--probes", path) == f"{path}:2: give exactly one of 'prompt' or 'messages'"


def test_duplicate_prompt_ids(refuse, tmp_path):
    path = _suite(tmp_path, '{"id": "a", "prompt": "x"}', '{"id": "b", "prompt": "y"}', '{"id": "a", "prompt": "z"}')
    assert refuse("--probes", path) == f"{path}:3: duplicate prompt id 'a' (first on line 1)"


def test_probe_file_with_a_lone_surrogate_or_deep_nesting(refuse, tmp_path):
    # A \\ud800 escape is valid JSON but not text: the tokenizer raised TypeError (a traceback), and in an
    # id it would reach the Parquet writer after the cell ran. Deep nesting raised RecursionError.
    for line in ('{"id": "a", "prompt": "x \\ud800 y"}', '{"id": "\\ud800", "prompt": "xy"}'):
        path = _suite(tmp_path, line)
        assert refuse("--probes", path).startswith(f"{path}:1: a string holds a lone UTF-16 surrogate")
    path = _suite(tmp_path, "[" * 100_000)
    assert refuse("--probes", path) == f"{path}:1: invalid JSON (nested too deeply)"


def test_unknown_probe_suite(refuse):
    assert refuse("--probes", "nope").startswith("unknown probe suite 'nope'; built-in suites: ")


@pytest.mark.parametrize("model, message", [
    ("builtin:nope", "unknown built-in model 'builtin:nope'"),
    ("./no/such/model", "--model './no/such/model': not a local directory"),
    ("nobody/no-such-model", "--model 'nobody/no-such-model': not found locally or on the Hugging Face Hub"),
])
def test_unknown_model_or_path(refuse, model, message):
    assert refuse("--model", model).startswith(message)


def test_model_directory_without_a_config(refuse, tmp_path):
    (tmp_path / "m").mkdir()
    assert refuse("--model", str(tmp_path / "m")) == f"--model {tmp_path / 'm'}: directory has no config.json"


@pytest.mark.parametrize("tp, message", [
    ("1,3", "--tp 3 does not divide the model's 16 attention heads"),
    ("16", "--tp 16 does not divide the model's 8 key/value heads"),
])
def test_tp_that_does_not_divide_the_heads(refuse, tp, message):
    assert refuse("--tp", tp) == message


@pytest.mark.parametrize("family, config, tp, message", [
    # Gemma 4's global-attention layers have num_global_key_value_heads: transformers raises on a
    # global read of a per-layer size, and `run` ended in a traceback at any TP.
    ("gemma4_text", {"num_attention_heads": 16, "num_key_value_heads": 8, "num_global_key_value_heads": 2,
                     "attention_k_eq_v": True}, "1,4", "--tp 4 does not divide the model's 2 key/value heads"),
    # Gemma 3n's intermediate_size is a list per layer: `list % int` ended in a TypeError.
    ("gemma3n_text", {"num_hidden_layers": 2, "intermediate_size": [64, 36], "num_attention_heads": 8,
                      "num_key_value_heads": 8}, "1,32", "--tp 32 does not divide the model's 8 attention heads"),
    ("gemma3n_text", {"num_hidden_layers": 2, "intermediate_size": [64, 36], "num_attention_heads": 8,
                      "num_key_value_heads": 8}, "1,2,4,8", "--tp 8 does not divide the model's 36 MLP width (intermediate_size)"),
])
def test_tp_checked_against_every_layer_of_the_config(refuse, tmp_path, family, config, tp, message):
    from transformers import AutoConfig

    AutoConfig.for_model(family, **config).save_pretrained(tmp_path / "m")
    assert refuse("--model", str(tmp_path / "m"), "--tp", tp) == message


def test_tp_larger_than_the_visible_gpus(refuse, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert refuse("--device", "cuda", "--tp", "1,4") == "--tp 4 needs 4 GPUs but 2 are visible"


def test_device_cuda_without_a_gpu(refuse, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert refuse("--device", "cuda", "--tp", "1") == \
        "--device cuda: no CUDA GPU is visible (torch.cuda.device_count() is 0); use --device cpu"


def test_tp_against_visible_devices_function():
    shape = ModelShape("qwen3", 16, 8, 192, 384, {"lm_head": "colwise_gather_output"})
    plan = expand(Matrix(model="m", tps=(1, 2, 8), device="cuda"))
    validate_against_model(plan, shape, None)  # CPU: no device limit
    validate_against_model(plan, shape, 4, nnodes=2)  # 8 GPUs over two nodes
    with pytest.raises(InputError, match="--tp 8 needs 8 GPUs but 4 are visible"):
        validate_against_model(plan, shape, 4)


@pytest.mark.parametrize("tp", ["3", "1,6", "16"])
def test_tbik_needs_power_of_two_tp(refuse, tp):
    bad = [t for t in tp.split(",") if t != "1"][0]
    assert refuse("--kernels", "stock,tbik", "--tp", tp) == \
        f"--kernels tbik needs TP sizes that are powers of two up to 8, got {bad}"


def test_unknown_nccl_preset(refuse):
    assert refuse("--nccl", "default,fastest").startswith("unknown NCCL preset 'fastest'; known: default, ring, tree")


@pytest.mark.parametrize("spec, message", [
    ("x:OMP_NUM_THREADS=4", "--nccl-set 'x:OMP_NUM_THREADS=4': 'OMP_NUM_THREADS' is not an NCCL_* variable"),
    ("x:LD_PRELOAD=/tmp/evil.so", "--nccl-set 'x:LD_PRELOAD=/tmp/evil.so': 'LD_PRELOAD' is not an NCCL_* variable"),
    ("x:NCCL_ALGO=Ring,PATH=/tmp", "--nccl-set 'x:NCCL_ALGO=Ring,PATH=/tmp': 'PATH' is not an NCCL_* variable"),
    ("x", "--nccl-set 'x': expected NAME:NCCL_VAR=VALUE[,NCCL_VAR=VALUE...]"),
    ("tree:NCCL_ALGO=Ring", "--nccl-set 'tree:NCCL_ALGO=Ring': 'tree' is a built-in preset; choose another name"),
])
def test_custom_nccl_settings_must_be_nccl_variables(refuse, spec, message):
    assert refuse("--nccl-set", spec) == message


@pytest.mark.parametrize("flag, value", [
    ("--tp", ""), ("--batch-size", ""), ("--mode", ""), ("--kernels", " "), ("--engine", ""), ("--nccl", ""),
])
def test_empty_matrix(refuse, flag, value):
    assert refuse(flag, value) == f"{flag} is empty: the matrix has no cells"


def test_non_numeric_matrix_values(refuse):
    assert refuse("--tp", "1,two") == "--tp '1,two': expected a comma-separated list of int values"
    assert refuse("--batch-size", ",") == "--batch-size ',': expected a comma-separated list of int values"
    assert refuse("--mode", "score,") == "--mode 'score,': expected a comma-separated list of str values"


def test_baseline_not_in_the_matrix(refuse):
    message = refuse("--tp", "1,2", "--baseline", "hf-tp8-bs1-default-stock")
    assert message.startswith("baseline 'hf-tp8-bs1-default-stock' is not a cell of the matrix (cells look like: ")


def test_refusals_leave_no_files(refuse, tmp_path):
    """Many refusals in a row: nothing is created next to --out either."""
    before = sorted(p.name for p in tmp_path.iterdir())
    refuse("--tp", "3")
    refuse("--nccl", "nope")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("flag, value", [
    ("--timeout", "0"), ("--timeout", "-5"), ("--load-timeout", "-1"), ("--timeout", "nan"),
])
def test_timeouts_must_be_positive(refuse, flag, value):
    assert refuse(flag, value) == f"{flag} {float(value):g}: must be a positive number of seconds"


def test_a_model_the_engine_cannot_run_is_refused_before_the_run_starts(refuse, tmp_path):
    """The engine's own config check (repaudit.engines.hf.cfg_check) runs in the parent, before the run
    directory exists: a model it refuses is one line and exit 2, not a failed job. (It refused Gemma 2's
    final_logit_softcapping inside the worker once; GPT-2 is a family it does not vouch for now.)"""
    import json

    from repaudit.engines import hf

    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 256, "n_embd": 64, "n_head": 2,
        "n_layer": 1, "n_positions": 64}))
    with pytest.raises(InputError) as engine_says:
        hf.cfg_check(str(model), False)
    assert refuse("--model", str(model), "--tp", "1") == str(engine_says.value)


def test_probe_file_that_is_not_a_file(refuse, tmp_path):
    assert refuse("--probes", "/dev/null") == \
        "/dev/null: probe suite has no prompts (the file is empty or blank; a suite is JSONL, one prompt per line)"
    assert refuse("--probes", str(tmp_path)) == f"{tmp_path}: a directory, not a probe suite (a .jsonl file)"


def test_usage_errors_are_one_line_too(refuse):
    assert refuse("--no-such-flag").startswith("No such option: --no-such-flag")
    assert refuse("--topk", "x").startswith("Invalid value for '--topk'")
    # more than the vocabulary: every cell's job failed in torch.topk, after loading the model
    assert refuse("--topk", "100000").startswith("--topk 100000 exceeds the model's vocabulary (")
