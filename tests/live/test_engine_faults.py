"""Faults on the live path, as a user sees them: the engine's process is killed mid-run (with and without
``--restart``), and a burst of extra load on the machine hits a running AIMD controller.

The CLI runs the engine in a child process (``probe.remote``); the tests kill that process with SIGKILL, the
way the kernel's OOM killer or a crash ends it, and look at what the CLI prints and what it left on disk.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from metronome.calibration import TokenStream

PERIOD = 0.1
BASE = ["--model", "tiny", "--num-blocks", "256", "--kv", "window", "--window", "128", "--stream", "0.1:14:2",
        "--arrival-rate", "2", "--session-duration", "60", "--admission", "static:6"]


def _jsonl(path):
    from metronome.probe.records import read_journal

    return read_journal(path)  # complete rows; the line being written is skipped


def _start(out, *extra):
    cmd = [sys.executable, "-m", "metronome.cli.probe_cli", "run", *BASE, "--out", str(out), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_engine_after(proc, out, frames: int, timeout: float = 600.0):
    """Wait until ``frames`` frames are journaled (the engine's start included: minutes on a busy host), then
    SIGKILL the engine's process; returns the wall time."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if len(_jsonl(out / "frames.jsonl")) >= frames:
            started = [e for e in _jsonl(out / "events.jsonl") if e["event"] == "engine_started"]
            assert started and started[0]["pid"] != proc.pid  # the engine is its own process
            os.kill(started[0]["pid"], signal.SIGKILL)
            return time.time()
        time.sleep(0.1)
    raise AssertionError("the run journaled too few frames before the timeout")


def _last_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _frames_complete(frames: pd.DataFrame, sessions: pd.DataFrame) -> None:
    """No frame record lost: each admitted session's frames are numbered 0..k-1 without a gap, and the session
    table's frame count is its frames answered (those the run's end left unanswered are censored)."""
    per = frames.groupby("session").frame.agg(["min", "max", "count"])
    assert (per["min"] == 0).all() and (per["count"] == per["max"] + 1).all(), per
    per["answered"] = frames[~frames.censored].groupby("session").size()
    adm = sessions[sessions.admitted].set_index("session")
    joined = per.fillna(0).join(adm.frames, how="inner")
    assert (joined["answered"] == joined["frames"]).all(), joined


def test_engine_killed_without_restart_stops_and_keeps_data(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, "--horizon", "120")
    try:
        t_kill = _kill_engine_after(proc, out, frames=40)
        stdout, stderr = proc.communicate(timeout=60)
        t_exit = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    line = _last_line(stderr)
    assert line.startswith("metronome-probe: error: the engine process (pid ") and "killed by SIGKILL" in line, line
    assert "what ran is kept" in line and "Traceback" not in stderr
    assert t_exit - t_kill < 30  # it noticed, wrote everything and left
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "engine_died" and summary["engine_deaths"] == 1
    assert summary["engine_restarts"] == 0 and "SIGKILL" in summary["engine_error"]
    # noticed within one control interval (1 s) of the engine's last step
    events = pd.read_parquet(out / "events.parquet")
    died = events[events.event == "engine_died"].t_s.iloc[0]
    steps = pd.read_parquet(out / "steps.parquet")
    assert 0 <= died - steps.t_s.max() <= 1.0, (died, steps.t_s.max())
    # everything recorded is on disk and readable; nothing was lost
    frames = pd.read_parquet(out / "frames.parquet")
    assert len(frames) >= 40 and len(frames) == len(_jsonl(out / "frames.jsonl")) == summary["frames"] + (
        frames.censored.sum())
    sessions = pd.read_parquet(out / "sessions.parquet")
    assert (sessions[sessions.admitted].reason == "engine_died").any()
    _frames_complete(frames, sessions)
    assert (out / "controller.parquet").exists() and (out / "engine.log").exists()


AFTER_BACK = 60  # spoken frames ticking a second after the engine is back that the restart test waits for


def _wait_back_and_talking(proc, out, timeout: float = 600.0) -> None:
    """Wait until the engine restarted and AFTER_BACK frames ticking a second after that got tokens (a restart
    takes ~35 s on a quiet host, minutes on a busy one: no fixed horizon fits both)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        back = [e["t_s"] for e in _jsonl(out / "events.jsonl") if e["event"] == "engine_restarted"]
        if back and sum(not f["censored"] and not f["silent"] and f["tick_s"] > back[0] + 1.0
                        for f in _jsonl(out / "frames.jsonl")) >= AFTER_BACK:
            return
        time.sleep(0.5)
    raise AssertionError(f"the engine was not back and talking within {timeout:g} s")


def test_engine_killed_with_restart_readmits_and_counts_the_outage(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, "--horizon", "900", "--restart")  # (a cap: the run is stopped once it showed the restart)
    try:
        _kill_engine_after(proc, out, frames=60)
        _wait_back_and_talking(proc, out)
        proc.send_signal(signal.SIGTERM)  # a clean stop: everything recorded is written
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    said = [ln for ln in stderr.splitlines() if ln.startswith("metronome-probe:")]
    assert any("killed by SIGKILL" in ln and "restarting it (1 of 3)" in ln for ln in said), said
    assert any("the engine is back" in ln for ln in said), said
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine_deaths"] == 1 and summary["engine_restarts"] == 1
    assert summary["stop_reason"] == "SIGTERM"  # (stopped by the test, not by the engine's death)
    (down, up), = summary["engine_outages"]
    assert summary["engine_outage_s"] == pytest.approx(up - down, abs=1e-3) and up > down
    events = pd.read_parquet(out / "events.parquet")
    lost = events[events.event == "lost"]
    assert len(lost) >= 1
    # every session that lost its KV came back as a rebase of its own history
    rebased = events[(events.event == "rebase") & (events.reason == "engine_restart")]
    assert set(lost.session) <= set(rebased.session), (lost.session.tolist(), rebased.session.tolist())
    frames = pd.read_parquet(out / "frames.parquet")
    done = frames[~frames.censored]
    # while the engine was down frames were answered silent, at their tick, not held until it was back: within a
    # second (a period, and the driver's own process starved by a busy host; the outage lasts tens of seconds)
    outage = done[(done.tick_s > down + PERIOD) & (done.tick_s < up - PERIOD)]
    assert len(outage) > 0 and outage.silent.all(), outage.head().to_string()
    assert (outage.latency_s <= PERIOD + 1.0).all(), outage.latency_s.max()
    # and after it the sessions spoke again (the run was stopped once AFTER_BACK frames had: _wait_back_and_talking)
    after = done[done.tick_s > up + 1.0]
    assert (~after.silent).sum() >= AFTER_BACK
    sessions = pd.read_parquet(out / "sessions.parquet")
    _frames_complete(frames, sessions)
    assert len(frames) == len(_jsonl(out / "frames.jsonl"))


# -- a latency spike: extra load on the machine, injected here ---------------------------------------------------
STREAM = TokenStream(PERIOD, 14, 2)


@pytest.fixture(scope="module")
def engine(engine_64):
    return engine_64  # (conftest: tiny on 64 blocks with this STREAM, shared with test_live_run.py)


def test_latency_spike_costs_one_cut_per_interval_and_recovers(engine, tmp_path):
    from metronome.admission import AIMDParams, make_controller
    from metronome.probe.live_run import make_plans, run
    from metronome.workload import Arrivals, Durations

    interval, spike_at, spike_s, horizon = 0.5, 5.0, 3.0, 14.0
    params = AIMDParams(interval_s=interval, initial_limit=2, max_limit=4, target_fraction=0.5,
                        decrease_factor=0.5)
    ctl = make_controller("aimd", 0.05, params)  # target: 25 ms; a frame here takes ~8 ms
    plans = make_plans(Arrivals("poisson", rate_per_s=6.0), Durations.parse("1.5"), horizon, seed=3)
    burners = []
    t = {}

    def hold(driver):
        t["t0"] = time.perf_counter()

    import threading

    def inject():
        while "t0" not in t:
            time.sleep(0.01)
        time.sleep(max(0.0, t["t0"] + spike_at - time.perf_counter()))
        code = "import time\nend = time.time() + %f\nwhile time.time() < end: pass\n" % spike_s
        burners.extend(subprocess.Popen([sys.executable, "-c", code]) for _ in range(4))

    th = threading.Thread(target=inject)
    th.start()
    try:
        res, summary = run(engine, STREAM, plans, horizon, ctl, tmp_path, deadline_s=0.05, on_driver=hold)
    finally:
        th.join()
        for b in burners:
            b.wait(timeout=30)
    trace = pd.read_parquet(tmp_path / "controller.parquet")
    print(trace[["t_s", "limit", "in_flight", "p_latency_s", "frames", "decision"]].to_string())  # shown on failure
    limit_before = trace[trace.t_s <= spike_at].limit.iloc[-1]
    during = trace[(trace.t_s > spike_at) & (trace.t_s <= spike_at + spike_s + interval)]
    cuts = during[during.decision == "decrease"]
    # the spike was seen...
    assert len(cuts) >= 1, trace.to_string()
    # ...and cost at most one multiplicative cut per control interval. One row per interval: the rows close
    # every 0.5 s (the interval set above), none skipped, none doubled (1e-6 s: float sums of 0.5).
    gaps = trace.t_s.diff().dropna()
    assert ((gaps - interval).abs() < 1e-6).all(), trace.to_string()
    # Each row moves the limit one step at most, by the scenario's settings, by hand (a = 1, b = 0.5,
    # limits 1..4, and a cut drops at least one session unless already at 1):
    #   a cut: 4 -> 2 (4·0.5), 3 -> 1 (floor 1.5 = 1), 2 -> 1, 1 stays 1 (the minimum)
    #   an increase: 1 -> 2, 2 -> 3, 3 -> 4, 4 stays 4 (the maximum)
    # Two cuts in one interval would show as 4 -> 1 or 3 -> 1 -> ... in one row.
    cut_to = {4: 2, 3: 1, 2: 1, 1: 1}
    grow_to = {1: 2, 2: 3, 3: 4, 4: 4}
    prev = [2] + trace.limit.tolist()[:-1]  # the first interval ran at initial_limit = 2
    for L, (_, r) in zip(prev, trace.iterrows()):
        want = {"decrease": cut_to[L], "increase": grow_to[L]}.get(r.decision, L)  # hold, draining, dead: kept
        assert r.limit == want, (r.t_s, L, r.decision, r.limit, trace.to_string())
        # no cut while the last cut's excess is still in flight (admission never evicts; the congestion
        # seen meanwhile is the one already answered): a cut only where the interval's peak in flight was
        # within the limit in force, "draining" only where it was above it
        if r.decision == "decrease":
            assert r.in_flight <= L, (r.t_s, L, r.in_flight, trace.to_string())
        if r.decision == "draining":
            assert r.in_flight > L, (r.t_s, L, r.in_flight, trace.to_string())
    # ...and the limit recovered once the load was gone
    after = trace[trace.t_s > spike_at + spike_s + 2 * interval]
    # Recovery needs latency back under the 25 ms target once the burners are gone. On a host busy with other work
    # the engine alone can stay above it (measured in one suite run: 40-56 ms a frame with one session in flight
    # for the 6 s after the spike, 61 ms before it), and then a cut is the right answer, not a failure to recover.
    target = 0.05 * params.target_fraction
    if not (after.p_latency_s <= target).any():
        pytest.skip(f"after the spike the engine never came back under the {target * 1e3:.0f} ms target "
                    f"({after.p_latency_s.min() * 1e3:.0f}-{after.p_latency_s.max() * 1e3:.0f} ms with at most "
                    f"{after.in_flight.max()} in flight): the host held latency up; recovery not testable on this run")
    assert (after.decision == "increase").any(), trace.to_string()
    assert after.limit.max() > during.limit.min(), trace.to_string()
    assert after.limit.max() >= limit_before - 1, trace.to_string()
