"""benchmarks/step_times.py: a plain run's model steps split into the long (prefill) steps and
the rest, on step times whose answer is known."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("step_times", ROOT / "benchmarks" / "step_times.py")
step_times = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step_times)


def test_a_step_longer_than_twice_the_runs_median_is_a_long_step():
    steps = [0.005, 0.006, 0.04, 0.005, 0.012, 0.0121, 0.005]  # median 0.006: 0.012 is not long, 0.0121 is
    long, rest = step_times.split(steps)
    assert long == [0.04, 0.0121]
    assert rest == [0.005, 0.006, 0.005, 0.012, 0.005]


def test_the_table_has_a_line_per_run_with_its_long_steps_in_ms(tmp_path, capsys, monkeypatch):
    row = {"kernels": "tbik", "tp": 2, "plain_runs_s": [0.07, 0.1, 0.09],
           "plain_step_s": [[0.005, 0.045, 0.005, 0.005], [0.005, 0.07, 0.005, 0.006], []]}
    path = tmp_path / "vllm_speed.json"
    path.write_text(json.dumps([row, {"kernels": "stock", "tp": 2}]))  # a row without --steps is left out
    monkeypatch.setattr("sys.argv", ["step_times.py", str(path)])
    step_times.main()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 0.")]
    assert lines == ["| 0.070 | 4 | 1, 0.045 | 45 | 0.015, 5.00 |", "| 0.100 | 4 | 1, 0.070 | 70 | 0.016, 5.00 |",
                     "| 0.090 | 0 | | | |"]  # a run whose worker timed no step
