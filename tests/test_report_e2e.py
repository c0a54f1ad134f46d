"""End to end on CPU: one small real run (module-scoped), `repaudit report` on it, report.html
opened in real headless Chromium over the DevTools protocol (no console errors, no request
leaving the page, every plot drawn, a full-page screenshot), and `repaudit gate` on the run.

Run as a script to screenshot any report the same way:
    python tests/test_report_e2e.py RUN_DIR/report.html shot.png
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("REPAUDIT_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--no-default-browser-check",
                  "--hide-scrollbars", "--mute-audio"]


# ------------------------------------------------------------------------------ a tiny CDP client


class Chromium:
    """Headless Chromium driven over the Chrome DevTools Protocol (one websocket, one page)."""

    def __init__(self, width: int = 1400, height: int = 1000, timeout: float = 30.0):
        from contextlib import ExitStack

        from websockets.sync.client import connect

        self.stack = ExitStack()
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="repaudit-chromium-")
        self.proc = subprocess.Popen(
            [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-port=0",
             f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        url = self._devtools_url()
        self.ws = self.stack.enter_context(connect(url, max_size=None, open_timeout=timeout))
        self.next_id = 0
        self.events: list[dict[str, Any]] = []
        page = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    def _devtools_url(self) -> str:
        deadline = time.monotonic() + self.timeout
        seen = []
        assert self.proc.stderr is not None
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                if self.proc.poll() is not None:
                    break
                continue
            seen.append(line)
            m = re.search(r"DevTools listening on (ws://\S+)", line)
            if m:
                return m.group(1)
        self.close()
        raise RuntimeError("chromium did not start:\n" + "".join(seen[-20:]))

    def call(self, method: str, session: bool = False, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        msg: dict[str, Any] = {"id": self.next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + self.timeout
        while True:
            reply = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str) -> dict[str, Any]:
        for ev in self.events:
            if ev.get("method") == method:
                return ev
        deadline = time.monotonic() + self.timeout
        while True:
            ev = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            self.events.append(ev)
            if ev.get("method") == method:
                return ev

    def open(self, url: str) -> None:
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        self.wait_for("Page.loadEventFired")

    def js(self, expression: str) -> Any:
        r = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"script failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def screenshot(self, path: Path) -> tuple[int, int]:
        """Full page, at CSS pixel scale."""
        import base64

        size = self.call("Page.getLayoutMetrics", session=True)["cssContentSize"]
        w, h = int(size["width"]), int(size["height"])
        shot = self.call("Page.captureScreenshot", session=True, format="png", captureBeyondViewport=True,
                         clip={"x": 0, "y": 0, "width": w, "height": h, "scale": 1})
        Path(path).write_bytes(base64.b64decode(shot["data"]))
        return w, h

    def problems(self) -> list[str]:
        """Console errors, uncaught exceptions, and requests for anything but the file itself."""
        out = []
        for ev in self.events:
            m, p = ev.get("method"), ev.get("params", {})
            if m == "Runtime.exceptionThrown":
                out.append(f"exception: {p['exceptionDetails'].get('text')}")
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert", "warning"):
                out.append(f"console.{p['type']}: {[a.get('value') for a in p.get('args', [])]}")
            elif m == "Log.entryAdded" and p["entry"].get("level") in ("error", "warning"):
                out.append(f"log {p['entry']['level']}: {p['entry'].get('text')} {p['entry'].get('url', '')}")
            elif m == "Network.requestWillBeSent" and not p["request"]["url"].startswith(("file:", "data:")):
                out.append(f"request: {p['request']['url']}")
        return out

    def close(self) -> None:
        try:
            if hasattr(self, "stack"):
                self.stack.close()
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The page check, in the page: every <svg> is laid out with a non-zero box and has drawn shapes.
PLOT_CHECK = """(() => {
  document.querySelectorAll('details').forEach(d => d.open = true);
  const svgs = [...document.querySelectorAll('svg')];
  return {
    svgs: svgs.map(s => { const r = s.getBoundingClientRect();
      return {cls: s.getAttribute('class'), label: s.getAttribute('aria-label'), w: r.width, h: r.height,
              shapes: s.querySelectorAll('rect, circle, path, line').length}; }),
    scripts: document.scripts.length,
    title: document.title,
    verdict: (document.getElementById('verdict') || {}).textContent || null,
    sections: [...document.querySelectorAll('h2')].map(h => h.textContent),
  };
})()"""


def check_page(html: Path, png: Path) -> dict[str, Any]:
    with Chromium() as browser:
        browser.open(html.resolve().as_uri())
        info = browser.js(PLOT_CHECK)
        info["size"] = browser.screenshot(png)
        info["problems"] = browser.problems()
    return info


# ------------------------------------------------------------------------------ the run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from repaudit import commands
    from repaudit.run.plan import Matrix
    from repaudit.run.runner import RunOptions

    out = tmp_path_factory.mktemp("e2e") / "cpu-tp12"
    matrix = Matrix(model="builtin:tiny-qwen3", device="cpu", dtype="float32", probes="smoke", tps=(1, 2), batch_sizes=(1, 4))
    argv = ["repaudit", "run", "--model", "builtin:tiny-qwen3", "--tp", "1,2", "--batch-size", "1,4", "--out", str(out)]
    assert commands.run(matrix, RunOptions(out=out, cell_timeout=600, load_timeout=600, argv=argv)) == 0
    return out


@pytest.fixture(scope="module")
def report(run_dir: Path) -> Path:
    from repaudit import cli

    assert cli.main(["report", str(run_dir)]) == 0
    return run_dir


pytestmark = pytest.mark.slow
XSD = Path(__file__).parent / "data" / "junit.xsd"
SHOT = os.environ.get("REPAUDIT_SCREENSHOT")  # also copy the screenshot here (e.g. reports/.../report.png)


def _pct_rows(summary: dict) -> list[tuple[str, str]]:
    from repaudit.compare.render import pct

    return [(r["cell"], f"{r['bitwise_equal']}/{r['compared']} ({pct(r['bitwise_equal'], r['compared'])})")
            for r in summary["cells"] if r["cell"] != r["reference"]]


def test_report_agrees_with_the_run_summary(report: Path):
    summary = json.loads((report / "summary.json").read_text())
    html, md = (report / "report.html").read_text(), (report / "report.md").read_text()
    rows = _pct_rows(summary)
    assert len(rows) == 6
    for cell, text in rows:  # the same exact counts as summary.json, in both files
        assert text in html and text in md, (cell, text)
    assert "DIVERGENT: 6 of 6 cell pairs fail the gate" in html  # fp32 TP=2 and batch 4 move bits on CPU
    for h in ("Each cell against its reference", "Cell × cell", "ULP distance", "RL mismatch", "Where sequences first diverge",
              "First divergent token", "Speed and time", "Environment fingerprint", "Reproduce"):
        assert h in html, h
    assert html.count('class="plot heatmap"') == 4 and html.count('class="plot histogram"') == 6 + 6  # ULP, log-ratio
    assert "text decoded with the tokenizer at" in html and "capital of Australia" in html  # decoded, not ids
    assert shlex_join(["repaudit", "run", "--model", "builtin:tiny-qwen3"]) in html
    assert "<script" not in html and "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")


def shlex_join(words: list[str]) -> str:
    import shlex

    return shlex.join(words)


def test_report_renders_in_chromium(report: Path, tmp_path: Path):
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: scripts/setup.sh installs Debian's chromium"
    html = report / "report.html"
    png = tmp_path / "report.png"
    info = check_page(html, png)
    assert info["problems"] == [], info["problems"]  # no console error, no exception, no request leaving the page
    assert info["scripts"] == 0 and info["title"] == f"repaudit report: {report.name}"
    assert info["verdict"].startswith("DIVERGENT: 6 of 6 cell pairs fail the gate")
    svgs = info["svgs"]
    assert len(svgs) == html.read_text().count("<svg") > 10
    for s in svgs:  # every plot was laid out with a real box and drew shapes
        assert s["w"] > 0 and s["h"] > 0 and s["shapes"] > 0, s
    kinds = [s["cls"] for s in svgs]
    assert kinds.count("plot heatmap") == 4 and kinds.count("plot histogram") == 6 + 6 and kinds.count("plot strip") == 1
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width == info["size"][0] >= 1000 and height == info["size"][1] > 2000
    if SHOT:
        shutil.copyfile(png, SHOT)


def test_gate_on_the_run_with_junit(run_dir: Path, tmp_path: Path, capsys):
    from lxml import etree

    from repaudit import cli

    junit = tmp_path / "junit.xml"
    assert cli.main(["gate", str(run_dir), "--junit", str(junit)]) == 1
    schema = etree.XMLSchema(etree.parse(str(XSD)))
    assert schema.validate(etree.parse(str(junit))), schema.error_log
    summary = json.loads((run_dir / "summary.json").read_text())
    want = {f"{r['cell']} vs {r['reference']}": "DIVERGENT: " + "; ".join(r["reasons"])
            for r in summary["cells"] if r["cell"] != r["reference"]}
    got = {c.get("name"): c.find("failure").get("message") for c in etree.parse(str(junit)).iter("testcase")}
    assert got == want  # the gate and summary.json agree, pair by pair
    assert cli.main(["gate", str(run_dir), "--max-ulp", "1000"]) == 0
    capsys.readouterr()


def test_forked_generation_shows_in_context(run_dir: Path, tmp_path: Path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from repaudit import cli
    from repaudit.records import read_meta, write_table

    run = tmp_path / "forked"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("report.*", ".lock"))
    path = run / "cells" / "hf-tp2-bs4-default-stock-generate.parquet"
    table = pq.read_table(path)
    pid = table.column("prompt_id").to_pylist()
    phase = table.column("phase").to_pylist()
    tok = table.column("token_id").to_numpy().copy()
    rows = [i for i, (p, ph) in enumerate(zip(pid, phase)) if p == "smoke-fact" and ph == "completion"]
    fork = rows[3]
    tok[fork:rows[-1] + 1] = ord("Z")  # from the 4th generated token on, this cell says "ZZZZ..."
    table = table.set_column(table.schema.get_field_index("token_id"), "token_id", pa.array(tok, pa.int32()))
    write_table(path, table, read_meta(path))
    assert cli.main(["report", str(run)]) == 0
    html = (run / "report.html").read_text()
    assert "token fork" in html and "1 fork" in html
    assert "&#x27;Z&#x27; #90" in html  # B's token, decoded
    rc = cli.main(["gate", str(run)])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 1 and "1 of 4 sequences differ in tokens or length (first: 'smoke-fact' at pos" in out


def test_diff_html_on_two_cells(run_dir: Path, tmp_path: Path, capsys):
    from repaudit import cli

    out = tmp_path / "pair.html"
    a, b = (run_dir / "cells" / f"hf-tp{t}-bs1-default-stock-score.parquet" for t in (1, 2))
    assert cli.main(["diff", str(a), str(b), "--html", str(out)]) == 1
    capsys.readouterr()
    html = out.read_text()
    assert "B against A" in html and "text decoded with the tokenizer at" in html and html.count("<svg") == 3
    info = check_page(out, tmp_path / "pair.png")
    assert info["problems"] == [] and all(s["w"] > 0 and s["h"] > 0 for s in info["svgs"])


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python tests/test_report_e2e.py REPORT.html OUT.png")
    result = check_page(Path(sys.argv[1]), Path(sys.argv[2]))
    print(json.dumps({k: v for k, v in result.items() if k != "svgs"}, indent=1))
    print(f"{len(result['svgs'])} svgs, zero-sized: {[s for s in result['svgs'] if not (s['w'] > 0 and s['h'] > 0)]}")
