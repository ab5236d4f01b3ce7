"""``calibrate`` with its stages phase on the live engine: after the backbone's phases the engine is closed, the
pipeline stages are timed and the calibration written with them. ``tiny`` has no pipeline, so it is given
Moshi's here (small shapes, the all-eager stack): the wiring, not the figures."""

import json

from metronome.calibration import load_file
from metronome.models import MODELS

OPTS = dict(model="tiny", grid_sessions=(1, 4), grid_context=(128, 512), decode_steps=4, chunk_sizes=(16,),
            chunk_repeats=1, fill_sessions=2, fill_seconds=2.0, paced_sessions=(1,), paced_seconds=0.0,
            growth_tokens=512, progress=False, time_stages=True, stack="vllm-omni-duplex")


def test_a_run_with_stages_writes_them_into_the_calibration(tmp_path, monkeypatch):
    from metronome.probe import calibrate

    monkeypatch.setattr(calibrate, "pipeline_model", lambda model: MODELS["moshi-7b"])
    opts = calibrate.CalibrateOptions(out=str(tmp_path / "cal"), **OPTS)
    res = calibrate.run_calibration(opts)
    cal = load_file(res.out_dir / "calibration.json")
    assert cal.provenance.kind == "measured" and cal.stack == "vllm-omni-duplex"
    stage = cal.stack_pricing("vllm-omni-duplex").terms
    assert len(stage) == 4 and all(t.basis == "measured" and t in cal.step_latency.terms for t in stage)
    # (>=: the backbone's own fitted per-sequence term can come out 0 on a tiny model, and is then not listed)
    assert cal.step_latency.per_seq_s >= sum(t.value for t in stage if t.coefficient == "per_seq_s") > 0
    assert json.loads((res.out_dir / "stages.json").read_text())["shapes"] == "small"
    assert json.loads((res.out_dir / "measurements.json").read_text())["stages"]["stack"] == "vllm-omni-duplex"
