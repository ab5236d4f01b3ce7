"""Calibration files: presets load, the arithmetic is right, and bad files fail in one line."""

import copy
import json

import pytest

from metronome import calibration as cal
from metronome.errors import CalibrationError
from metronome.roofline import estimate

ARCH = {  # layers, KV heads, head_dim, bytes/token, by hand from each model's published config
    "moshi-7b": (32, 32, 128, 524_288),
    "qwen2.5-omni-7b": (28, 4, 128, 57_344),
    "qwen3-omni-30b-a3b": (48, 4, 128, 98_304),
    "minicpm-o-4.5": (36, 8, 128, 147_456),
}


def test_every_model_ships_on_both_gpus():
    from metronome.models import MODELS

    names = set(cal.preset_names())
    assert set(ARCH) <= set(MODELS)
    for model in MODELS:
        for gpu in ("h200", "b200"):
            assert f"{model}-{gpu}" in names


@pytest.mark.parametrize("name", cal.preset_names())
def test_presets_load_and_are_estimated_with_their_arithmetic(name):
    c = cal.load(name)
    m = c.model
    # each model's backbone config vs its shape: test_one_table_of_models_feeds_the_presets_and_the_probe
    if name.rsplit("-", 1)[0] in ARCH:  # the models checked by hand against their published shapes
        layers, kvh, hd, per_tok = ARCH[name.rsplit("-", 1)[0]]
        assert (m.layers, m.kv_heads, m.head_dim) == (layers, kvh, hd)
        assert c.kv_bytes_per_token == per_tok == 2 * layers * kvh * hd * 2
    assert c.engine.bytes_per_block == c.kv_bytes_per_token * c.engine.block_size_tokens
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
    (lambda d: d["step_latency"].update(base_s=d["step_latency"]["base_s"] * 1.01), "step_latency.terms"),
    (lambda d: d["step_latency"]["terms"][0].update(basis="hunch"), "step_latency.terms[0].basis"),
    (lambda d: d["step_latency"]["plugin_terms"][1].update(coefficient="per_frame_s"),
     "step_latency.plugin_terms[1].coefficient"),
    (lambda d: d["step_latency"]["plugin_terms"][0].update(value=-1e-3), "step_latency.plugin_terms[0].value"),
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
    # one sequence: its 1,000 context tokens are the summed read and the mean sequence's read both
    assert c.step_s(1, 1000, 1) - one == pytest.approx(1000 * (c.per_context_token_s + c.per_mean_context_token_s))
    two = c.step_s(2, 0, 2)
    assert c.step_s(2, 1000, 2) - two == pytest.approx(1000 * c.per_context_token_s + 500 * c.per_mean_context_token_s)


# ------------------------------------------------------------------------------ the GPU presets' prices
# Every expected value below is worked by hand from the figures the presets quote (metronome.roofline.ANCHORS),
# not taken from the code: Llama 3.1 8B on an H100 decodes a batch-1 step in 5.1 ms with CUDA graphs and 8.4 ms
# eager; a blocking device-to-host copy stalls a step ~2 ms; Qwen3-Omni's audio RTF on an H100 goes 0.400 -> 0.578
# from 16 to 32 concurrent requests. Tolerance: relative 1e-9, float arithmetic in another order.
H100_BW, H200_BW, B200_BW = 3.35e12, 4.8e12, 8.0e12


def _term(terms, name):
    (t,) = [t for t in terms if t.name.startswith(name)]
    return t


def test_the_plugin_costs_eager_mode_the_host_copy_and_the_compaction():
    sl = cal.load("moshi-7b-h200").step_latency
    eager = _term(sl.plugin_terms, "eager")
    assert eager.value == pytest.approx(32 * (8.4e-3 - 5.1e-3) / 32, rel=1e-9)  # Moshi has 32 layers, like Llama 8B
    assert eager.basis == "anchored" and "8.4 ms" in eager.source
    assert _term(sl.plugin_terms, "block table copied to the host (the sync)").value == pytest.approx(2e-3)
    # the copy itself: 65,536 tokens / 16 per block x 4 B = 16,384 B a request over 64 GB/s
    assert _term(sl.plugin_terms, "block table copied to the host (the bytes)").value == pytest.approx(16_384 / 64e9)
    assert _term(sl.plugin_terms, "compaction").basis == "measured"
    q3 = cal.load("qwen3-omni-30b-a3b-b200").step_latency
    assert _term(q3.plugin_terms, "eager").value == pytest.approx(48 * 3.3e-3 / 32, rel=1e-9)


def test_qwen3_omni_prices_its_speech_pipeline_from_vllm_omnis_measurement():
    sl = cal.load("qwen3-omni-30b-a3b-h200").step_latency
    speech = [_term(sl.terms, f"{st}: work per session") for st in ("talker", "code predictor", "Code2Wav")]
    # 0.178 s of H100 time per second of speech for 16 more streams, scaled to the H200's bandwidth, for half of
    # the conversation, spread over the 2 backbone steps of a 1 s frame: the three speech stages' work together
    assert sum(t.value for t in speech) == pytest.approx((0.578 - 0.400) / 16 * (H100_BW / H200_BW) * 0.5 * 1.0 / 2,
                                                         rel=1e-9)
    assert all(t.basis == "anchored" and "PR #3695" in t.source for t in speech)
    # the audio encoder: 25 positions/s x 2 x 0.6e9 FLOP at half of 989 TFLOP/s, over 2 steps a frame
    assert _term(sl.terms, "audio encoder: work").value == pytest.approx(25 * 2 * 0.6e9 / (989e12 * 0.5) / 2,
                                                                         rel=1e-9)
    # vLLM's own step: the 5.1 ms batch-1 step less 16.06 GB of Llama weights at 3.35 TB/s
    assert _term(sl.terms, "vLLM per step").value == pytest.approx(5.1e-3 - 16.06e9 / H100_BW, rel=1e-9)
    # the routed experts (48 layers x 128 experts x gate, up, down of 2048 x 768 in bf16) are priced by the share a
    # step reads; the rest of the 61 GB the thinker streams is read every step
    experts = 48 * 128 * 3 * 2048 * 768 * 2
    assert _term(sl.terms, "routed experts").value == pytest.approx(experts / H200_BW, rel=1e-9)
    assert _term(sl.terms, "weights").value == pytest.approx((61e9 - experts) / H200_BW, rel=1e-9)
    assert sl.moe_route == 8 / 128


def test_moshi_prices_its_depformer_and_codec_passes_every_frame():
    sl = cal.load("moshi-7b-b200").step_latency  # the default stack: every stage batched with CUDA graphs
    per_pass = (0.578 - 0.400) / 16 / (12.5 + 15 * 12.5 + 12.5) * (H100_BW / B200_BW)  # one pass, one session
    # the depformer as timed on an H200 (docs/gpu-pricing.md: 2.27 ms a frame + 7.2 us a session, batched with
    # graphs), one frame a backbone step: the launch-bound part carried as it is, the per-session part by bandwidth
    assert _term(sl.terms, "depformer: per launch").value == pytest.approx(2.2665444e-3, rel=1e-6)
    assert _term(sl.terms, "depformer: per session").value == pytest.approx(7.230065e-6 * H200_BW / B200_BW, rel=1e-6)
    assert _term(sl.terms, "depformer: per launch").basis == "measured"
    # 2 Mimi passes per 80 ms frame, every frame (full duplex); a pass launches 12 layers at the depformer's
    # measured 2.2665 ms / 48 layers with graphs
    assert _term(sl.terms, "Mimi encoder + decoder: work").value == pytest.approx(2 * per_pass, rel=1e-9)
    assert _term(sl.terms, "Mimi encoder + decoder: per launch").value == pytest.approx(2 * 12 * 2.2665444e-3 / 48,
                                                                                        rel=1e-6)
    assert {t.basis for t in sl.terms} >= {"anchored", "datasheet", "estimated", "measured"}


def test_the_policy_decides_whether_the_plugin_is_priced():
    from metronome.kv_policy import KVPolicy

    c = cal.load("qwen3-omni-30b-a3b-b200")
    plugin = sum(t.value for t in c.step_latency.plugin_terms if t.coefficient == "base_s")
    sinks = c.step_latency_for(KVPolicy.sinks(16, 16, 1760))
    assert sinks.base_s == pytest.approx(c.step_latency.base_s + plugin, rel=1e-12)
    assert sinks.per_seq_s > c.step_latency.per_seq_s and sinks.plugin_terms == ()
    # vLLM's own sliding window and the unbounded engine run as vLLM runs any model
    for policy in (KVPolicy.window(16, 1760), KVPolicy.unbounded(16)):
        assert c.step_latency_for(policy) == c.step_latency


def test_a_measured_calibration_has_no_plugin_terms_to_add():
    c = cal.load("moshi-7b-h200")
    from dataclasses import replace

    from metronome.kv_policy import KVPolicy

    bare = replace(c, step_latency=replace(c.step_latency, terms=(), plugin_terms=()))
    assert bare.step_latency_for(KVPolicy.sinks(16, 16, 368)) == bare.step_latency


def test_the_deadline_binds_before_memory_for_qwen3_omni_on_b200():
    """The issue's example: W = 1760 on a B200. Datasheet-only pricing put the deadline-bound N* at 4,539
    against a memory ceiling of 499; priced per frame, the deadline binds."""
    from metronome.kv_policy import KVPolicy
    from metronome.sim.capacity import capacity

    c = cal.load("qwen3-omni-30b-a3b-b200")
    for policy in (KVPolicy.sinks(16, 16, 1760), KVPolicy.window(16, 1760)):
        cap = capacity(c, policy)
        assert cap["binding"] == "deadline" and cap["deadline_n_star"] < cap["memory_ceiling"], cap
    # the plugin's costs cost sessions: fewer under sinks than under vLLM's own window at the same W
    assert capacity(c, KVPolicy.sinks(16, 16, 1760))["deadline_n_star"] < capacity(c, KVPolicy.window(16, 1760))["deadline_n_star"]


def test_one_table_of_models_feeds_the_presets_and_the_probe():
    """metronome.models is the one table: each backbone config vLLM loads has the shape the presets price, the
    probe's presets are the table's, and each shipped preset file carries its model's stream."""
    from metronome.models import MODELS
    from metronome.probe.models import PRESETS

    assert sorted(p.name.rsplit("-", 1)[0] for p in map(cal.load, cal.preset_names())) == sorted(3 * list(MODELS))
    for m in MODELS.values():
        c = m.backbone_config
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        assert (c["num_hidden_layers"], c["num_key_value_heads"], head_dim) == (
            m.shape.layers, m.shape.kv_heads, m.shape.head_dim), m.key
        assert c["max_position_embeddings"] == m.shape.max_model_len_tokens, m.key
        assert PRESETS[m.probe_name].stream == m.stream and PRESETS[m.probe_name].hf_config == c
        for gpu in ("h100", "h200", "b200"):
            assert cal.load(f"{m.key}-{gpu}").stream == m.stream


# Each model's real-time stream (frame period s, input and output tokens a frame) and KV bytes a token, as its
# sources state them, written here by hand (not read from metronome.models, which this checks; the sources are in
# the models' stream_note and the shared model notes): Moshi fuses text and 8+8 audio codebooks into one KV position
# per 80 ms frame (12.5 Hz), 32 layers x 32 KV heads x 128 in bf16; Qwen2.5-Omni's thinker hears 25 audio tokens/s
# in TMRoPE chunks of 2 s and writes ~4 text tokens a chunk, 28 x 4 x 128; Qwen3-Omni's thinker 13 audio tokens/s
# (the 12.5 Hz encoder's length formula) per 1 s frame, 2 text tokens out, 48 x 4 x 128; MiniCPM-o 4.5 decides once a
# second (1 Hz duplex unit: <unit>, 10 audio tokens, 2 markers in; ~8 speak tokens out), Qwen3-8B's 36 x 8 x 128.
PINNED_STREAMS = {
    "moshi-7b": ((0.08, 0, 1), 2 * 32 * 32 * 128 * 2),
    "qwen2.5-omni-7b": ((2.0, 50, 4), 2 * 28 * 4 * 128 * 2),
    "qwen3-omni-30b-a3b": ((1.0, 13, 2), 2 * 48 * 4 * 128 * 2),
    "minicpm-o-4.5": ((1.0, 12, 8), 2 * 36 * 8 * 128 * 2),
}


def test_each_models_stream_is_what_its_sources_say():
    from metronome.models import MODELS

    assert sorted(MODELS) == sorted(PINNED_STREAMS)
    for key, ((period, n_in, n_out), kv_bytes) in PINNED_STREAMS.items():
        m = MODELS[key]
        got = (m.stream.frame_period_s, m.stream.input_tokens_per_frame, m.stream.output_tokens_per_frame)
        assert got == (period, n_in, n_out), key
        assert m.shape.kv_bytes_per_token == kv_bytes, key
        for gpu in ("h100", "h200", "b200"):  # and each shipped preset carries them
            c = cal.load(f"{key}-{gpu}")
            assert (c.stream.frame_period_s, c.stream.input_tokens_per_frame,
                    c.stream.output_tokens_per_frame) == (period, n_in, n_out), (key, gpu)
            assert c.kv_bytes_per_token == kv_bytes, (key, gpu)


def test_the_step_models_form_is_stated_once():
    """A new term of the step-latency model is a coefficient, its unit and its input in metronome/calibration.py
    (:func:`step_inputs`), its fit and its tests. No other code names a coefficient, except the roofline, which
    prices the estimated presets term by term, and the GPU decode-step micro-benchmark, which fits its own
    attention-only model."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    allowed = {root / "metronome" / "calibration.py", root / "metronome" / "roofline.py",
               root / "probe" / "decode_step.py"}
    name = re.compile(r"\b(per_seq_s|per_context_token_s|per_new_token_s|moe_experts_s)\b|\.base_s\b")
    found = [f"{f.relative_to(root)}:{no}: {line.strip()}"
             for folder in ("metronome", "sim", "probe", "benchmarks", "examples")
             for f in sorted((root / folder).rglob("*.py")) if f not in allowed
             for no, line in enumerate(f.read_text().splitlines(), 1) if name.search(line)]
    assert found == [], "\n".join(found)


def test_step_s_is_the_coefficients_times_the_inputs():
    # hand arithmetic: 2 ms + 3 × 0.1 ms + 1000 × 1 ns + 4 × 20 us
    m = cal.StepLatencyModel(base_s=2e-3, per_seq_s=1e-4, per_context_token_s=1e-9, per_new_token_s=2e-5)
    assert m.step_s(3, 1000, 4) == pytest.approx(2e-3 + 3e-4 + 1e-6 + 8e-5, rel=1e-12)
    assert m.coefficients == (2e-3, 1e-4, 1e-9, 2e-5, 0.0, 0.0)
    # + 1000 / 3 context tokens of the mean sequence x 300 ns
    mean = cal.StepLatencyModel(base_s=2e-3, per_seq_s=1e-4, per_context_token_s=1e-9, per_new_token_s=2e-5,
                                per_mean_context_token_s=3e-7)
    assert mean.step_s(3, 1000, 4) == pytest.approx(2e-3 + 3e-4 + 1e-6 + 8e-5 + 1e-4, rel=1e-12)
    assert mean.step_s(0, 0, 0) == pytest.approx(2e-3, rel=1e-12)  # (an empty step: no mean sequence)
    assert set(cal.COEFFICIENT_UNITS) == set(cal.COEFFICIENTS) == set(cal.sum_terms(()))


def test_a_coefficient_with_a_default_may_be_absent_and_the_others_may_not(monkeypatch):
    """A term added after files were written reads as its default; the loader still requires the rest."""
    d = cal.load("moshi-7b-h200").to_dict()
    del d["step_latency"]["per_context_token_s"]
    d["step_latency"].pop("terms", None)  # terms must add up to the coefficients; this test is not about them
    d["step_latency"].pop("plugin_terms", None)
    d.pop("stacks", None), d.pop("stack", None)  # (a stack's terms are among the step's terms)
    with pytest.raises(CalibrationError, match="per_context_token_s': missing"):
        cal.from_dict(copy.deepcopy(d))
    monkeypatch.setattr(cal, "_COEFFICIENT_DEFAULTS", {**cal._COEFFICIENT_DEFAULTS, "per_context_token_s": 0.0})
    assert cal.from_dict(copy.deepcopy(d)).step_latency.per_context_token_s == 0.0
