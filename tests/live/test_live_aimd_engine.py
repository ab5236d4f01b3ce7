"""metronome.probe.live_aimd on the real engine: one short live AIMD run of the benchmark's scenario, its traces
read back and compared with the simulated run of the same seed (benchmarks/bench_live_aimd.py, in seconds)."""

from dataclasses import replace

import pytest

from metronome.calibration import TokenStream
from metronome.results import settled_mean

STREAM = TokenStream(0.1, 14, 2)
NUM_BLOCKS, WINDOW, HORIZON = 64, 128, 8.0


@pytest.fixture(scope="module")
def engine(tiny_model):
    from metronome.probe.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(tiny_model.with_stream(STREAM), num_blocks=NUM_BLOCKS,
                              max_model_len=(NUM_BLOCKS - 2) * 32, sliding_window=WINDOW))
    yield eng
    eng.close()


def test_live_aimd_run_beside_the_simulator(engine, tmp_path):
    from metronome import calibration
    from metronome.probe import live_aimd as la
    from metronome.sim import scenario as sc_mod

    aimd = la.aimd_for(la.AIMD, 8, 1.0)
    summary = la.run_live_aimd(engine, STREAM, tmp_path / "window", aimd=aimd, deadline=0.1, rate=2.0,
                               duration="3", horizon=HORIZON, seed=1)
    assert summary["controller"]["name"] == "aimd" and summary["sessions_admitted"] >= 1
    assert summary["load_avg_start"] >= 0 and summary["load_avg_end"] >= 0
    live = la.live_trace(tmp_path / "window")
    t, n, ctl = live
    assert t.size == n.size > 0 and len(ctl) >= HORIZON / aimd["interval_s"] - 1

    # the simulated side: the same scenario and seed on a calibration with the run's stream and block size
    cal = calibration.load("moshi-7b-h200")
    cal = replace(cal, stream=STREAM, engine=replace(cal.engine, block_size_tokens=32))
    res = sc_mod.run(la.scenario(cal, aimd, window=WINDOW, num_blocks=NUM_BLOCKS, rate=2.0, duration="3",
                                 horizon=HORIZON, deadline=0.1, seed=1))
    row = la.compare_run(live, summary, la.sim_trace(res), res, HORIZON)
    assert row["live"]["settled_sessions"] == settled_mean(t, n, HORIZON) is not None
    assert row["live"]["sessions_planned"] == summary["sessions_planned"]
    assert res.summary["sessions_offered"] == summary["sessions_offered"]  # the same sessions arrived
    assert row["sim"]["settled_sessions"] is not None
