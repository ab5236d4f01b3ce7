"""report.html in a real browser (Debian's headless Chromium, driven over the DevTools protocol on a pipe):
no JavaScript errors, every figure drawn with data, and the answer table shows report.md's numbers.

The page is screenshotted (a test artifact under pytest's tmp dir; with METRONOME_SAVE_SCREENSHOT=PATH
the top of the page is copied to PATH). The test skips, saying why, where chromium is not installed.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from test_report import answer_rows_from_markdown, shared_report

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (apt-get install chromium)")

WIDTH = 1440
TOP_HEIGHT = 1700  # the answer and the pool-fill figure: the screenshot the README shows

# Every figure, what Plotly drew: traces with data, and the SVG/canvas elements that show them.
INSPECT_JS = r"""
(() => {
  const out = [];
  for (const gd of document.querySelectorAll('.js-plotly-plot')) {
    const traces = (gd._fullData || []).map(t => {
      let n = 0;
      if (t.type === 'heatmap') { n = (t.z || []).reduce((a, r) => a + (r || []).filter(v => v !== null).length, 0); }
      else { n = (t.y || []).filter(v => v !== null && v !== undefined).length; }
      return {type: t.type, name: t.name || '', points: n, visible: t.visible};
    });
    out.push({
      id: gd.id, width: gd.clientWidth, height: gd.clientHeight,
      hasLayout: !!gd._fullLayout, traces,
      scatterPaths: gd.querySelectorAll('.scatterlayer .trace path.js-line').length,
      scatterPoints: gd.querySelectorAll('.scatterlayer .trace .points path').length,
      barPaths: Array.from(gd.querySelectorAll('.barlayer .trace .point path')).filter(p => {
        const b = p.getBBox(); return b.width > 0 && b.height > 0; }).length,
      barTexts: Array.from(gd.querySelectorAll('.barlayer .trace .point text')).map(e => e.textContent),
      // every y axis's category labels, top of the page first (subplot k's ticks are classed "y<k>tick")
      ylabels: Array.from(gd.querySelectorAll('text')).filter(e => [e, e.parentNode].some(x =>
          /^y\d*tick$/.test(((x && x.getAttribute && x.getAttribute('class')) || '').trim())))
        .map(e => [e.getBoundingClientRect().top, e.textContent]).sort((a, b) => a[0] - b[0]).map(p => p[1]),
      heatmapImages: gd.querySelectorAll('.heatmaplayer image, .hm image').length,
      xtitles: Array.from(gd.querySelectorAll('.g-xtitle text, .g-x2title text, [class^="g-x"][class$="title"] text')).map(e => e.textContent),
      ytitles: Array.from(gd.querySelectorAll('[class^="g-y"][class$="title"] text')).map(e => e.textContent),
    });
  }
  const shown = id => {
    const table = document.getElementById(id);
    const rows = table ? Array.from(table.querySelectorAll('tbody tr')).map(tr =>
        Array.from(tr.querySelectorAll('td')).map(td => td.textContent)) : null;
    const header = table ? Array.from(table.querySelectorAll('thead th')).map(th => th.textContent) : null;
    return {header, rows};
  };
  return JSON.stringify({figures: out, answer: shown('answer-table'), fleet: shown('fleet-table'),
                         height: document.documentElement.scrollHeight,
                         plotly: typeof Plotly !== 'undefined' ? Plotly.version : null,
                         external: Array.from(document.querySelectorAll('script[src], link[href]')).map(e => e.src || e.href)});
})()
"""


class Chromium:
    """A headless Chromium on a DevTools pipe (fds 3 and 4; no port, no websocket)."""

    def __init__(self, binary: str, profile: Path):
        to_child_r, self._to_child_w = os.pipe()
        self._from_child_r, from_child_w = os.pipe()
        # move the child's ends above 10 so that placing them on fds 3 and 4 cannot clobber each other
        a = fcntl.fcntl(to_child_r, fcntl.F_DUPFD_CLOEXEC, 10)
        b = fcntl.fcntl(from_child_w, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(to_child_r)
        os.close(from_child_w)

        def place_fds():  # runs in the child before exec; dup2 makes 3 and 4 inheritable
            os.dup2(a, 3)
            os.dup2(b, 4)

        args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--hide-scrollbars", "--mute-audio", "--no-first-run", "--remote-debugging-pipe",
                f"--user-data-dir={profile}", "about:blank"]
        self.proc = subprocess.Popen(args, preexec_fn=place_fds, close_fds=False, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.close(a)
        os.close(b)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []

    def _read_message(self, deadline: float) -> dict:
        import select

        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("chromium did not answer in time")
            r, _, _ = select.select([self._from_child_r], [], [], left)
            if r:
                chunk = os.read(self._from_child_r, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed the DevTools pipe: "
                                       + (self.proc.stderr.read().decode(errors="replace")[-2000:] if self.proc.stderr else ""))
                self._buf += chunk
        msg, _, self._buf = self._buf.partition(b"\0")
        return json.loads(msg)

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout_s: float = 60.0) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        data = json.dumps(msg).encode() + b"\0"
        while data:
            data = data[os.write(self._to_child_w, data):]
        deadline = time.monotonic() + timeout_s
        while True:
            m = self._read_message(deadline)
            if m.get("id") == self._id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def wait_event(self, method: str, timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        for e in self.events:
            if e.get("method") == method:
                return e
        while True:
            m = self._read_message(deadline)
            self.events.append(m)
            if m.get("method") == method:
                return m

    def close(self):
        try:
            self.send("Browser.close", timeout_s=10)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_child_w)
        os.close(self._from_child_r)


def render(page: Path, workdir: Path, clips: dict[str, tuple[int, int]] | None = None) -> dict:
    """Open the page, let every figure draw, and return what the page shows, its errors and screenshots."""
    profile = Path(tempfile.mkdtemp(prefix="chromium-profile-", dir=workdir))
    b = Chromium(CHROMIUM, profile)
    try:
        target = b.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        s = b.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for m in ("Page.enable", "Runtime.enable", "Log.enable"):
            b.send(m, session=s)
        b.send("Emulation.setDeviceMetricsOverride",
               {"width": WIDTH, "height": 1000, "deviceScaleFactor": 1, "mobile": False}, session=s)
        b.send("Page.navigate", {"url": page.resolve().as_uri()}, session=s)
        b.wait_event("Page.loadEventFired", timeout_s=120)
        # figures are drawn by the page's own scripts; wait until each has its layout
        deadline = time.monotonic() + 60
        while True:
            r = b.send("Runtime.evaluate", {"expression": "Array.from(document.querySelectorAll('.plotly-graph-div'))"
                                            ".every(g => g._fullLayout && g.querySelector('.main-svg')) && "
                                            "document.querySelectorAll('.plotly-graph-div').length", "returnByValue": True},
                       session=s)
            if r["result"].get("value") or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        time.sleep(0.5)
        state = json.loads(b.send("Runtime.evaluate", {"expression": INSPECT_JS, "returnByValue": True},
                                  session=s)["result"]["value"])
        shots = {}
        views = {"top": (0, TOP_HEIGHT), "full": (0, state["height"]), **(clips or {})}
        for name, (y, height) in views.items():
            png = b.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True,
                                                    "clip": {"x": 0, "y": y, "width": WIDTH, "height": height,
                                                             "scale": 1}}, session=s, timeout_s=120)["data"]
            shots[name] = base64.b64decode(png)
        errors = []
        for e in b.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                errors.append(f"exception: {d.get('text')} {d.get('exception', {}).get('description', '')}")
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                errors.append("console.error: " + " ".join(str(a.get("value", a.get("description", "")))
                                                           for a in p.get("args", [])))
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                errors.append(f"log: {p['entry'].get('text')} ({p['entry'].get('url', '')})")
        return {"state": state, "errors": errors, "shots": shots}
    finally:
        b.close()


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    out = shared_report(tmp_path_factory)
    work = tmp_path_factory.mktemp("browser")
    result = render(out / "report.html", work)
    for name, png in result["shots"].items():
        (work / f"report-{name}.png").write_bytes(png)
    result["artifacts"] = work
    target = os.environ.get("METRONOME_SAVE_SCREENSHOT")
    if target:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(work / "report-top.png", target)
    return {**result, "out": out}


def test_no_javascript_errors(page):
    assert page["errors"] == []
    assert page["state"]["plotly"], "plotly.js did not load from the page itself"
    assert page["state"]["external"] == [], "the page must not load anything from outside (it opens offline)"


def test_every_figure_is_drawn_with_data(page):
    figs = page["state"]["figures"]
    assert [f["id"] for f in figs] == ["fig-tornado", "fig-gpus", "fig-fill", "fig-metastability", "fig-signal",
                                       "fig-admission"]
    for f in figs:
        if f["id"] == "fig-tornado":
            continue  # bars, not lines: test_the_tornado_is_drawn_with_the_reports_numbers
        assert f["hasLayout"] and f["width"] > 800 and f["height"] > 400, f["id"]
        data = [t for t in f["traces"] if t["points"] > 0]
        assert len(data) >= 8, f"{f['id']}: only {len(data)} traces with data"
        assert f["ytitles"] and all(t.strip() for t in f["ytitles"]), f"{f['id']}: an axis without a title"
        if f["id"] == "fig-metastability":
            assert f["heatmapImages"] >= 8, "a heatmap was not painted"
            assert all(t["points"] >= 20 for t in f["traces"] if t["type"] == "heatmap")
        else:
            assert f["scatterPaths"] >= 8, f"{f['id']}: lines not drawn"
    fill = next(f for f in figs if f["id"] == "fig-fill")
    assert fill["scatterPoints"] >= 100, "the simulated points of the pool fill were not drawn"


def test_the_fleet_table_in_the_page_shows_the_numbers_in_report_md(page):
    from test_report import md_section, md_tables

    table = md_tables(md_section((page["out"] / "report.md").read_text(), "How many GPUs"))[0]
    shown = page["state"]["fleet"]
    assert shown["header"] == table[0] and shown["rows"] == table[1:]


def test_answer_table_in_the_page_shows_the_numbers_in_report_md(page):
    header, rows = answer_rows_from_markdown((page["out"] / "report.md").read_text())
    shown = page["state"]["answer"]
    assert shown["header"][1:] == header[1:]
    assert shown["rows"] == rows


def test_screenshot_is_saved(page):
    top = page["artifacts"] / "report-top.png"
    full = page["artifacts"] / "report-full.png"
    assert top.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and full.stat().st_size > top.stat().st_size > 50_000


def test_the_tornado_is_drawn_with_the_reports_numbers(page):
    """The sensitivity chart: for each calibration, a bar to each ranged term's N* at its low and at its high, in
    report.json's order (widest swing on top), each labelled with its N*; a bar that moves N* is painted."""
    data = json.loads((page["out"] / "report.json").read_text())
    (fig,) = [f for f in page["state"]["figures"] if f["id"] == "fig-tornado"]
    assert fig["hasLayout"] and fig["width"] > 800 and fig["height"] > 400
    texts, terms, moving = [], [], 0
    for c in data["calibrations"]:
        r = c["capacity"]["ranges"]
        for b in r["tornado"][:12]:  # the chart's widest twelve
            terms.append(b["term"])
            for end in ("low", "high"):
                n = b[f"deadline_n_star_at_{end}_sessions"]
                texts.append(f"{n:,}")
                moving += n != r["deadline_n_star_sessions"]
    assert fig["barPaths"] >= moving > 4, (fig["barPaths"], moving)
    assert sorted(fig["barTexts"]) == sorted(texts)
    bars = [t for t in fig["traces"] if t["type"] == "bar"]
    assert len(bars) == 2 * len(data["calibrations"]) and all(t["points"] > 0 for t in bars)
    shown = [t.rstrip("…") for t in fig["ylabels"]]  # (a long name is cut short on the axis)
    assert len(shown) == len(terms) and all(w.startswith(s) for w, s in zip(terms, shown)), shown
