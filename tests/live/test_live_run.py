"""`metronome-probe run`: live admission with the simulator's controllers, Prometheus, and faults.

One engine (tiny, 64 blocks) is shared by the in-process tests; the CLI tests start their own in a
subprocess. Latencies are never asserted tightly: the box has 2 noisy cores.
"""

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pandas as pd
import pytest

from metronome.calibration import TokenStream

STREAM = TokenStream(0.1, 14, 2)
NUM_BLOCKS = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line_error(r):
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def engine(engine_64):
    return engine_64  # (conftest: tiny on NUM_BLOCKS blocks with this STREAM, shared with test_engine_faults.py)


# -- bad input: one line, exit 2, before any engine starts ------------------------------------------------
def test_bad_input_one_line_exit_2(probe, tmp_path):
    base = ["run", "--model", "tiny", "--out", str(tmp_path / "o"), "--horizon", "5", "--session-duration", "3"]
    bad_params = tmp_path / "bad.json"
    bad_params.write_text(json.dumps({"params": {"additive_increase": "fast"}}))
    not_object = tmp_path / "list.json"
    not_object.write_text("[1, 2]")
    bad_pattern = tmp_path / "pattern.txt"
    bad_pattern.write_text("10:1\nten:two\n")
    cases = [
        (["--arrival-rate", "1", "--admission", "aimd", "--aimd-params", str(bad_params)], "additive"),
        (["--arrival-rate", "1", "--admission", "aimd", "--aimd-params", str(not_object)], "JSON object"),
        (["--arrival-rate", "1", "--admission", "static:0"], "static admission limit"),
        (["--rate-pattern", str(bad_pattern)], "cannot parse the rate pattern"),
    ]
    with socket.socket() as held:  # a metrics port already in use
        held.bind(("0.0.0.0", 0))
        held.listen()
        cases.append((["--arrival-rate", "1", "--metrics-port", str(held.getsockname()[1])], "not available"))
        for extra, needle in cases:
            r = probe(*base, *extra, timeout=600)
            assert r.returncode == 2, (extra, r.stderr[-2000:])
            line = _one_line_error(r)
            assert line.startswith("metronome-probe: error:") and needle in line, (extra, r.stderr[-2000:])
            assert "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()


def test_tune_aimd_file_is_read(tmp_path):
    from metronome.admission import AIMDParams

    f = tmp_path / "aimd.json"
    f.write_text(json.dumps({"params": {"additive_increase": 2.0, "interval_s": 0.5}, "figures": {"x": 1}}))
    p = AIMDParams.from_file(str(f))
    assert p.additive_increase == 2.0 and p.interval_s == 0.5


def test_plans_are_the_simulators_workload():
    from metronome.probe.live_run import make_plans
    from metronome.workload import Arrivals, Durations

    arr, dur = Arrivals.parse_pattern("2:1,2:4,2:1"), Durations.parse("exp:3")
    plans = make_plans(arr, dur, 6.0, seed=7)
    import numpy as np

    rng = np.random.default_rng(7)  # sim.scenario.workload: arrivals first, then durations, one generator
    t = arr.times(rng, 6.0)
    d = dur.sample(rng, t.size)
    assert [p.arrival_s for p in plans] == list(t) and [p.duration_s for p in plans] == list(d)


# -- engines in one process ------------------------------------------------------------------------------
def test_closing_an_engine_leaves_another_in_the_process_running(engine, tiny_model):
    """vLLM's in-process EngineCore tears the process's distributed state down as it shuts; an engine still open
    beside it stepped next with ``pipeline model parallel group is not initialized`` (a shared test engine broke
    after another test's engine closed)."""
    from metronome.probe.engine import Engine, EngineConfig

    other = Engine(EngineConfig(tiny_model, num_blocks=16, max_model_len=14 * 32))
    other.close()
    engine.reset()
    engine.append("after-close", [1] * 14, max_tokens=2)
    steps = engine.drain()
    engine.reset()
    assert steps and sum(s.new_tokens for s in steps) >= 14 + 1  # the prompt and a decode, on the open engine


# -- a run with AIMD, scraped over HTTP while it runs -----------------------------------------------------
def _scrape(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    vals = {}
    for ln in text.splitlines():
        if ln and not ln.startswith("#"):
            name, _, v = ln.rpartition(" ")
            vals[name] = float(v)
    return vals


def test_aimd_run_outputs_and_prometheus_scrape(engine, tmp_path):
    from metronome.admission import AIMDParams, make_controller
    from metronome.probe.live_run import make_plans, run
    from metronome.workload import Arrivals, Durations

    port = _free_port()
    ctl = make_controller("aimd", STREAM.frame_period_s, AIMDParams(interval_s=0.5))
    plans = make_plans(Arrivals("poisson", rate_per_s=3.0), Durations.parse("3"), 6.0, seed=1)
    box = {}
    th = threading.Thread(target=lambda: box.update(res=run(engine, STREAM, plans, 6.0, ctl, tmp_path,
                                                            prometheus_port=port, deadline_s=0.1)))
    th.start()
    scrapes = []
    deadline = time.time() + 60
    while th.is_alive() and time.time() < deadline:
        try:
            scrapes.append(_scrape(port))
        except OSError:
            pass
        time.sleep(0.3)
    th.join(60)
    assert scrapes, "the metrics endpoint never answered during the run"
    last = scrapes[-1]
    for name in ("metronome_admission_limit", "metronome_sessions_admitted_total", "metronome_frame_latency_p50_seconds",
                 "metronome_frame_latency_p99_seconds", "metronome_silent_frame_rate", "metronome_kv_pool_usage",
                 "metronome_preemptions_total", "metronome_engine_silent"):
        assert name in last, name
    assert max(s.get("metronome_sessions_admitted_total", 0) for s in scrapes) >= 1
    assert max(s.get("metronome_frames_total", 0) for s in scrapes) > 0
    res, summary = box["res"]
    # every output is there and agrees with what the driver recorded
    frames = pd.read_parquet(tmp_path / "frames.parquet")
    assert len(frames) == len(res.frames) == sum(1 for _ in open(tmp_path / "frames.jsonl"))
    ctrl = pd.read_parquet(tmp_path / "controller.parquet")
    assert {"limit", "in_flight", "p_latency_s", "silent", "silent_fraction", "decision"} <= set(ctrl.columns)
    assert len(ctrl) >= 8  # 0.5 s intervals over 6 s
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["stopped"] is False and on_disk["controller"]["name"] == "aimd"
    assert on_disk["sessions_offered"] == len(plans) == on_disk["sessions_planned"]
    assert on_disk["sessions_admitted"] + on_disk["sessions_refused"] <= on_disk["sessions_offered"]
    assert on_disk["engine_silent_episodes"] == 0


def test_a_policy_the_engine_does_not_run_is_refused(engine, tmp_path):
    from metronome.admission import make_controller
    from metronome.errors import MetronomeError
    from metronome.kv_policy import KVPolicy
    from metronome.probe.live_run import run

    with pytest.raises(MetronomeError, match=r"the engine runs unbounded, not window\(W=128\)"):
        run(engine, STREAM, [], 1.0, make_controller("none", 0.1), tmp_path, policy=KVPolicy.window(32, 128))


# -- fault: a dead signal / a stalled engine ---------------------------------------------------------------
class _Pausable:
    """The engine, except that between ``start`` and ``end`` (perf_counter) a step produces nothing: a stalled
    engine that keeps being scheduled but yields no token."""

    def __init__(self, engine):
        self._e, self.start, self.end = engine, float("inf"), float("inf")

    def __getattr__(self, name):
        return getattr(self._e, name)

    def step(self, wait_s=None):
        from metronome.probe.engine import StepInfo

        now = time.perf_counter()
        if self.start <= now < self.end:
            time.sleep(0.01)
            return StepInfo(t_start=now, duration_s=0.01, batch=1, new_tokens=0, context_tokens=0, prefill_tokens=0)
        return self._e.step(wait_s)


def test_dead_signal_stalled_engine(engine, tmp_path):
    from metronome.admission import AIMDParams, make_controller
    from metronome.probe.driver import SessionPlan
    from metronome.probe.live_run import run

    interval, pause_at, pause_s = 0.5, 2.0, 3.0
    port = _free_port()
    ctl = make_controller("aimd", 0.1, AIMDParams(interval_s=interval, dead_intervals=2, initial_limit=4,
                                                    target_fraction=1.0))
    plans = [SessionPlan(f"d{i}", arrival_s=0.25 * i, duration_s=20.0) for i in range(28)]  # steady arrivals
    eng = _Pausable(engine)
    t = {}

    def hold(driver):
        t["t0"] = time.perf_counter()
        eng.start, eng.end = t["t0"] + pause_at, t["t0"] + pause_at + pause_s

    box = {}
    th = threading.Thread(target=lambda: box.update(res=run(eng, STREAM, plans, 7.0, ctl, tmp_path, deadline_s=0.1,
                                                            prometheus_port=port, on_driver=hold)))
    th.start()
    seen_silent = False
    while th.is_alive():
        try:
            seen_silent |= _scrape(port).get("metronome_engine_silent", 0) == 1
        except OSError:
            pass
        time.sleep(0.2)
    th.join()
    res, summary = box["res"]
    trace = pd.read_parquet(tmp_path / "controller.parquet")
    dead = trace[trace.decision == "dead"]
    # the controller saw the dead signal, refused, and did not grow while it lasted
    assert len(dead) >= 1, trace.to_string()
    stall = trace[(trace.t_s - interval >= pause_at - 0.05) & (trace.t_s <= pause_at + pause_s)]  # inside the pause
    assert (stall.decision != "increase").all(), trace.to_string()
    before = trace.loc[: stall.index[0] - 1]  # the intervals before the pause
    assert stall.limit.max() <= before.limit.iloc[-1], trace.to_string()
    sessions = pd.read_parquet(tmp_path / "sessions.parquet")
    t_dead_from = dead.t_s.min()  # the trace and the plans share the run's own clock
    admitted_while_dead = sessions[(sessions.admitted) & (sessions.arrival_s > t_dead_from + 0.05)
                                   & (sessions.arrival_s < dead.t_s.max() - 0.05)]
    assert admitted_while_dead.empty, admitted_while_dead.to_string()
    # the engine was flagged silent within about one control interval, in the summary, events and metrics
    assert summary["engine_silent_episodes"] >= 1 and summary["engine_silent_s"] >= 1.0
    ev = [e for e in res.events if e["event"] == "engine_silent"]
    assert ev and ev[0]["t_s"] - pause_at <= interval + 0.75, ev  # noisy box: 0.75 s slack
    assert seen_silent
    # nothing lost: every frame record is on disk
    assert len(pd.read_parquet(tmp_path / "frames.parquet")) == len(res.frames)
    # and it recovered: frames completed after the pause
    assert any(f["done_s"] is not None and f["done_s"] > pause_at + pause_s and not f["silent"] for f in res.frames)


# -- fault: SIGTERM to the CLI mid-run ---------------------------------------------------------------------
def test_sigterm_clean_stop(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "metronome.cli.probe_cli", "run", "--model", "tiny", "--out", str(out),
           "--num-blocks", "64", "--stream", "0.1:14:2", "--arrival-rate", "2", "--session-duration", "30",
           "--admission", "aimd", "--horizon", "900", "--kv", "budget", "--budget", "160", "--sinks", "32"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 600  # (the engine's start included: minutes on a busy host)
        journal = out / "frames.jsonl"
        while time.time() < deadline and proc.poll() is None:
            if journal.exists() and sum(1 for _ in open(journal)) >= 20:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    line = _one_line_error(subprocess.CompletedProcess(cmd, 0, stdout, stderr))
    assert line.startswith("metronome-probe: stopped by SIGTERM"), stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] is True and summary["stop_reason"] == "SIGTERM"
    assert summary["t_stopped_s"] < 900  # stopped by the signal, before its horizon
    frames = pd.read_parquet(out / "frames.parquet")
    assert len(frames) >= 20 and len(frames) == sum(1 for _ in open(out / "frames.jsonl"))
    sessions = pd.read_parquet(out / "sessions.parquet")
    assert (sessions[sessions.admitted].reason == "SIGTERM").any()
    assert (out / "controller.parquet").exists()
    # the trial policy, a KV budget, reached the engine from its registry line alone: the run checks that the
    # engine's KV spec keeps what the policy keeps (the plugin's S = 32, W = 160 - 32) before it starts, and names
    # the run as the user named the policy, its options flat as the report reads them
    assert {k: summary["options"][k] for k in ("kv", "budget", "sinks")} == {"kv": "budget", "budget": 160, "sinks": 32}
    assert set(frames.run) == {"budget(B=160, S=32)"}
