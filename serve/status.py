"""The server's status page: ``GET /`` (one HTML page, its script and style inline, nothing fetched from elsewhere)
and ``GET /status.json``, the figures it draws.

:class:`StatusHistory` keeps one sample a second for the last ten minutes in a ring buffer (a bounded ``deque``),
taken by a task on the app's event loop (:meth:`StatusHistory.run`, started with the app). A sample is what
``/metrics`` already says (:meth:`metronome.probe.metrics.LiveMetrics.status`): sessions active, the admission
limit, the p99 frame latency. The current figures include the N* of the engine's calibration when the server has
one (a line beside the limit on the page). Like ``/metrics`` it carries no session content: no session ids, no token ids,
no text, only counts and latencies over all sessions.

The page is kept here as a string rather than as a file beside this module so that it is installed wherever the
package is (the package's data files are declared one by one in pyproject.toml).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

PERIOD_S = 1.0  # one sample a second ...
SPAN_S = 600.0  # ... for the last ten minutes
SERIES = ("t", "sessions_active", "admission_limit", "p99_ms")  # a sample, in this order
FIGURES = ("sessions_active", "admission_limit", "p99_ms", "p50_ms", "refused", "refused_by_reason", "admitted",
           "frames", "silent_rate", "kv_pool_usage", "engine_up", "n_star")  # LiveMetrics.status()'s keys


class StatusHistory:
    """The ring buffer of samples behind ``/status.json``; every method runs on the app's event loop."""

    def __init__(self, period_s: float = PERIOD_S, span_s: float = SPAN_S):
        self.period_s, self.span_s = float(period_s), float(span_s)
        self.samples: deque = deque(maxlen=max(1, round(span_s / period_s)))
        self.errors = 0  # samples that failed (shown in the JSON: a sampler that stopped would look idle)

    @staticmethod
    def current(state) -> dict:
        """The figures now: the server's state (as ``/ready`` tells it), what the metrics say, the deadline."""
        gw = state.gateway
        phase = ("draining" if state.draining else "starting" if gw is None else
                 "ready" if gw.serving else "stopped")  # stopped: the gateway ended (the engine died)
        figures = state.metrics.status() if state.metrics is not None else dict.fromkeys(FIGURES)
        deadline = round(gw.cfg.deadline * 1e3, 3) if gw is not None else None
        return {"state": phase, "ready": state.ready, "draining": state.draining, **figures, "deadline_ms": deadline}

    def sample(self, state, now: float | None = None) -> None:
        c = self.current(state)
        now = time.time() if now is None else now
        self.samples.append((round(now, 3), c["sessions_active"], c["admission_limit"], c["p99_ms"]))

    async def run(self, state) -> None:
        """Sample every ``period_s``, on the second, until cancelled."""
        while True:
            try:
                self.sample(state)
            except Exception:  # noqa: BLE001 (a failed read must not end the sampling: it is counted instead)
                self.errors += 1
            await asyncio.sleep(self.period_s - time.time() % self.period_s)

    def report(self, state) -> dict:
        """``/status.json``: the figures now and the samples, a column per series (at most ``span_s /
        period_s`` each)."""
        cols = list(zip(*self.samples)) if self.samples else [()] * len(SERIES)
        return {"now": round(time.time(), 3), "period_s": self.period_s, "span_s": self.span_s,
                "capacity": self.samples.maxlen, "sampler_errors": self.errors, "current": self.current(state),
                "series": {k: list(col) for k, col in zip(SERIES, cols)}}


PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>metronome-serve</title>
<style>
  body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; padding: 16px 24px;
         color: #1d232b; background: #f5f6f8; }
  header { display: flex; align-items: baseline; gap: 12px; }
  h1 { font-size: 20px; margin: 0 0 12px; }
  .badge { padding: 2px 10px; border-radius: 10px; font-weight: 600; background: #ccc; }
  .badge.ready { background: #cdeccd; color: #185c18; }
  .badge.starting, .badge.draining { background: #f7e3b5; color: #6b4b00; }
  .badge.stopped, .badge.unreachable { background: #f5c7c7; color: #7a1212; }
  #conn, #updated { color: #667; font-size: 12px; }
  .cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(150px, 1fr)); gap: 10px; margin: 8px 0 16px; }
  .card { background: #fff; border-radius: 6px; padding: 8px 12px; box-shadow: 0 1px 2px #0002; }
  .card .k { color: #667; font-size: 12px; }
  .card .v { font-size: 22px; font-weight: 600; font-variant-numeric: tabular-nums; }
  .card .s { color: #667; font-size: 12px; min-height: 1em; }
  .chart { background: #fff; border-radius: 6px; padding: 8px 12px; margin-bottom: 14px; box-shadow: 0 1px 2px #0002; }
  .chart h2 { font-size: 14px; margin: 0 0 4px; font-weight: 600; }
  .legend span { margin-right: 14px; font-size: 12px; color: #445; }
  .legend i { display: inline-block; width: 18px; height: 0; border-top-width: 2px; border-top-style: solid;
              vertical-align: middle; margin-right: 4px; }
  .legend i.limit, .legend i.deadline { border-top-style: dashed; }
  svg { width: 100%; height: auto; display: block; }
  svg .grid { stroke: #e3e5e8; stroke-width: 1; }
  svg .ylab { font-size: 12px; fill: #667; text-anchor: end; }
  svg .xlab { font-size: 12px; fill: #667; text-anchor: middle; }
  svg polyline { fill: none; stroke-width: 2; stroke-linejoin: round; }
  .sessions { stroke: #2a6fdb; border-color: #2a6fdb; }
  .limit { stroke: #d9822b; border-color: #d9822b; stroke-dasharray: 6 4; }
  .p99 { stroke: #7b3fc4; border-color: #7b3fc4; }
  .deadline { stroke: #c43f3f; border-color: #c43f3f; stroke-dasharray: 4 4; stroke-width: 1.5; }
  .nstar { stroke: #2e9a5b; border-color: #2e9a5b; stroke-dasharray: 2 4; stroke-width: 1.5; }
  .legend i.nstar { border-top-style: dotted; }
  footer { color: #667; font-size: 12px; }
</style>
</head>
<body data-samples="0">
<header>
  <h1>metronome-serve</h1>
  <span id="state" class="badge">&ndash;</span>
  <span id="updated"></span>
  <span id="conn"></span>
</header>
<section class="cards">
  <div class="card"><div class="k">sessions active</div><div class="v" id="sessions">&ndash;</div>
    <div class="s" id="admitted"></div></div>
  <div class="card"><div class="k">admission limit</div><div class="v" id="limit">&ndash;</div>
    <div class="s" id="engine"></div></div>
  <div class="card"><div class="k">N* (calibration)</div><div class="v" id="nstar">&ndash;</div>
    <div class="s">the limit the calibration predicts</div></div>
  <div class="card"><div class="k">p99 frame latency</div><div class="v" id="p99">&ndash;</div>
    <div class="s" id="p50"></div></div>
  <div class="card"><div class="k">sessions refused</div><div class="v" id="refused">&ndash;</div>
    <div class="s" id="refused-why"></div></div>
  <div class="card"><div class="k">silent frames (last 500)</div><div class="v" id="silent">&ndash;</div>
    <div class="s" id="frames"></div></div>
  <div class="card"><div class="k">KV pool usage</div><div class="v" id="kv">&ndash;</div><div class="s"></div></div>
</section>
<section class="chart">
  <h2>Sessions active and the admission limit</h2>
  <div class="legend"><span><i class="sessions"></i>sessions active</span>
    <span><i class="limit"></i>admission limit</span><span id="nstar-key" hidden><i class="nstar"></i>N*</span></div>
  <svg id="chart-sessions" viewBox="0 0 1000 220" role="img" aria-label="sessions active and admission limit"></svg>
</section>
<section class="chart">
  <h2>p99 frame latency (ms, last 500 non-silent frames)</h2>
  <div class="legend"><span><i class="p99"></i>p99</span><span><i class="deadline"></i>deadline</span></div>
  <svg id="chart-p99" viewBox="0 0 1000 220" role="img" aria-label="p99 frame latency"></svg>
</section>
<footer>One sample a second, the last ten minutes, from <a href="status.json">status.json</a>;
  the series themselves are on <a href="metrics">/metrics</a>. No session content is shown.</footer>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const NS = "http://www.w3.org/2000/svg";
const POLL_MS = 1000;

function el(tag, attrs, text) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}
function num(v, digits) {
  if (v === null || v === undefined) return "\u2013";
  return digits === undefined ? String(v) : v.toFixed(digits);
}
function ms(v) { return v === null || v === undefined ? "\u2013" : (v < 10 ? v.toFixed(2) : v.toFixed(1)) + " ms"; }
function pct(v) { return v === null || v === undefined ? "\u2013" : (100 * v).toFixed(1) + " %"; }
// A round step for about four gridlines up to v (a whole one for counts).
function niceStep(v, whole) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of (whole ? [1, 2, 5, 10] : [1, 2, 2.5, 5, 10])) if (m * p >= v) return Math.max(m * p, whole ? 1 : 0);
  return 10 * p;
}

// One chart: the given series against time (the last span_s seconds up to the server's now), a line broken
// where a value is null; ``step`` draws a value as held until the next sample (the limit changes in steps);
// ``whole``: the values are counts.
function draw(svg, s, lines, refs, whole) {
  const W = 1000, H = 220, L = 48, R = 24, T = 10, B = 24;
  const t = s.series.t, t1 = s.now, t0 = t1 - s.span_s;
  let top = 0;
  for (const ln of lines) for (const v of s.series[ln.key]) if (v !== null) top = Math.max(top, v);
  for (const r of refs) if (r.value !== null) top = Math.max(top, r.value);
  const dy = niceStep(top * 1.1 / 4, whole);
  top = dy * Math.max(1, Math.ceil(top * 1.1 / dy));
  const x = (tt) => L + (W - L - R) * (tt - t0) / (t1 - t0);
  const y = (v) => T + (H - T - B) * (1 - Math.min(v, top) / top);
  svg.replaceChildren();
  for (let i = 0; i * dy <= top + 1e-9; i++) {
    const v = i * dy;
    svg.append(el("line", {x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid"}));
    svg.append(el("text", {x: L - 6, y: y(v) + 4, class: "ylab"}, Number.isInteger(v) ? v : v.toFixed(1)));
  }
  for (let m = 0; m * 60 <= s.span_s; m += 2) {
    svg.append(el("text", {x: x(t1 - m * 60), y: H - 6, class: "xlab"}, m ? "\u2212" + m + " min" : "now"));
  }
  for (const r of refs) {
    if (r.value !== null) svg.append(el("line", {x1: L, x2: W - R, y1: y(r.value), y2: y(r.value), class: r.cls}));
  }
  for (const ln of lines) {
    const vals = s.series[ln.key];
    let pts = [], prev = null;
    const flush = () => {
      if (pts.length) svg.append(el("polyline", {points: pts.join(" "), class: ln.cls, "data-series": ln.key}));
      pts = [];
    };
    t.forEach((tt, i) => {
      const v = vals[i];
      if (v === null || tt < t0) { flush(); prev = null; return; }
      if (ln.step && prev !== null) pts.push(x(tt).toFixed(1) + "," + y(prev).toFixed(1));
      pts.push(x(tt).toFixed(1) + "," + y(v).toFixed(1));
      prev = v;
    });
    flush();
  }
}

function render(s) {
  const c = s.current;
  const badge = $("state");
  badge.textContent = c.state;
  badge.className = "badge " + c.state;
  $("sessions").textContent = num(c.sessions_active);
  $("admitted").textContent = c.admitted === null ? "" : c.admitted + " admitted in all";
  $("limit").textContent = c.admission_limit === null ? (c.sessions_active === null ? "\u2013" : "none")
                                                      : String(c.admission_limit);
  $("engine").textContent = c.engine_up === false ? "engine down" : "";
  $("nstar").textContent = num(c.n_star);
  $("nstar-key").hidden = c.n_star === null || c.n_star === undefined;
  $("p99").textContent = ms(c.p99_ms);
  $("p50").textContent = "p50 " + ms(c.p50_ms) + (c.deadline_ms === null ? "" : ", deadline " + ms(c.deadline_ms));
  $("refused").textContent = num(c.refused);
  const why = c.refused_by_reason || {};
  $("refused-why").textContent = Object.keys(why).sort().map((k) => k + " " + why[k]).join(", ");
  $("silent").textContent = pct(c.silent_rate);
  $("frames").textContent = c.frames === null ? "" : c.frames + " frames in all";
  $("kv").textContent = pct(c.kv_pool_usage);
  draw($("chart-sessions"), s, [{key: "sessions_active", cls: "sessions"},
                                {key: "admission_limit", cls: "limit", step: true}],
       [{value: c.n_star === undefined ? null : c.n_star, cls: "nstar"}], true);
  draw($("chart-p99"), s, [{key: "p99_ms", cls: "p99"}], [{value: c.deadline_ms, cls: "deadline"}], false);
  document.body.dataset.samples = String(s.series.t.length);
  $("updated").textContent = "updated " + new Date(s.now * 1000).toLocaleTimeString();
  $("conn").textContent = s.sampler_errors ? s.sampler_errors + " samples failed" : "";
}

async function poll() {
  try {
    const r = await fetch("status.json", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
  } catch (e) {
    $("state").textContent = "unreachable";
    $("state").className = "badge unreachable";
    $("conn").textContent = "status.json: " + e.message;
  }
  setTimeout(poll, POLL_MS);  // (after the answer: polls never pile up behind a slow server)
}
poll();
</script>
</body>
</html>
"""
