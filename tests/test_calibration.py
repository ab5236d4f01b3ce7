"""Calibration files: presets load, the arithmetic is right, and bad files fail in one line."""

import copy
import json

import pytest

from metronome import calibration as cal
from metronome.errors import CalibrationError
from metronome.roofline import estimate

ARCH = {  # layers, KV heads, head_dim, bytes/token from the shared architecture notes
    "moshi-7b": (32, 32, 128, 524_288),
    "qwen2.5-omni-7b": (28, 4, 128, 57_344),
    "qwen3-omni-30b-a3b": (48, 4, 128, 98_304),
    "minicpm-o-4.5": (36, 8, 128, 147_456),
}


def test_every_model_ships_on_both_gpus():
    names = set(cal.preset_names())
    for model in ARCH:
        for gpu in ("h200", "b200"):
            assert f"{model}-{gpu}" in names


@pytest.mark.parametrize("name", cal.preset_names())
def test_presets_load_and_are_estimated_with_their_arithmetic(name):
    c = cal.load(name)
    layers, kvh, hd, per_tok = ARCH[name.rsplit("-", 1)[0]]
    assert (c.model.layers, c.model.kv_heads, c.model.head_dim) == (layers, kvh, hd)
    assert c.kv_bytes_per_token == per_tok == 2 * layers * kvh * hd * 2
    assert c.engine.bytes_per_block == per_tok * c.engine.block_size_tokens
    assert c.provenance.kind == "estimated"
    assert any("KV bytes/token" in n for n in c.provenance.notes)
    # the shipped file is exactly what the roofline computes today (no stale presets)
    model, gpu = name.rsplit("-", 1)
    assert c.to_dict() == estimate(model, gpu).to_dict()


def test_pool_blocks_follow_memory_minus_weights():
    h200, b200 = cal.load("moshi-7b-h200"), cal.load("moshi-7b-b200")
    # (141e9*0.9 - 15.4e9 - 4e9) / (512 KiB * 16)
    assert h200.engine.num_blocks == int((141e9 * 0.9 - 15.4e9 - 4e9) // (524_288 * 16))
    assert b200.engine.num_blocks > h200.engine.num_blocks


def test_round_trip(tmp_path):
    c = cal.load("qwen3-omni-30b-a3b-h200")
    p = tmp_path / "c.json"
    p.write_text(c.to_json())
    again = cal.load(str(p))
    assert again.to_dict() == c.to_dict()


def _broken(tmp_path, mutate):
    d = cal.load("moshi-7b-h200").to_dict()
    mutate(d)
    p = tmp_path / "broken.json"
    p.write_text(json.dumps(d))
    with pytest.raises(CalibrationError) as e:
        cal.load(str(p))
    msg = str(e.value)
    assert "\n" not in msg and str(p) in msg
    return msg


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d["engine"].pop("num_blocks"), "engine.num_blocks"),
    (lambda d: d["engine"].update(num_blocks=0), "engine.num_blocks"),
    (lambda d: d["engine"].update(num_blocks=1.5), "engine.num_blocks"),
    (lambda d: d["model"].update(kv_dtype="fp13"), "model.kv_dtype"),
    (lambda d: d["stream"].update(output_tokens_per_frame=0), "stream.output_tokens_per_frame"),
    (lambda d: d["stream"].update(frame_period_s=-0.08), "stream.frame_period_s"),
    (lambda d: d["step_latency"].update(per_seq_s="fast"), "step_latency.per_seq_s"),
    (lambda d: d["step_latency"].update(fitted_range={"batch": [10, 1]}), "step_latency.fitted_range.batch"),
    (lambda d: d["provenance"].update(kind="guessed"), "provenance.kind"),
    (lambda d: d.pop("provenance"), "provenance"),
    (lambda d: d.update(schema="metronome.calibration/99"), "schema"),
])
def test_bad_fields_name_file_and_field(tmp_path, mutate, field):
    assert f"field '{field}'" in _broken(tmp_path, mutate)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(CalibrationError, match="moshi-7b-h200"):
        cal.load("moshi-9000")


def test_malformed_and_missing_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CalibrationError, match="not valid JSON"):
        cal.load(str(bad))
    with pytest.raises(CalibrationError, match="no such calibration file"):
        cal.load(str(tmp_path / "missing.json"))
    notobj = tmp_path / "list.json"
    notobj.write_text("[1, 2]")
    with pytest.raises(CalibrationError, match="must be a JSON object"):
        cal.load(str(notobj))


def test_step_latency_is_the_linear_form():
    c = cal.load("moshi-7b-h200").step_latency
    one = c.step_s(1, 0, 1)
    assert c.step_s(2, 0, 2) - one == pytest.approx(c.per_seq_s + c.per_new_token_s)
    assert c.step_s(1, 1000, 1) - one == pytest.approx(1000 * c.per_context_token_s)
