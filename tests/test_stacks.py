"""Serving stacks and term ranges: each preset prices its model's stages as each shipped stack runs them
(metronome.models.STACKS, metronome.roofline), the calibration swaps stacks and terms (Calibration.with_stack,
with_term, terms_for), every term has a range (StepTerm.bounds), and the CLI takes --stack.

Expected figures are worked by hand from the measurements the presets quote (docs/gpu-pricing.md,
docs/measured/decode_step-h200-run2.json), not read from the code under test."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from metronome import calibration as cal
from metronome.errors import CalibrationError
from metronome.kv_policy import KVPolicy


def run_cli(argv, columns=200):
    """metronome-sim in a subprocess, as a user runs it (its stdout; it must succeed)."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "metronome.cli.sim_cli", *argv], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "COLUMNS": str(columns)})
    assert r.returncode == 0, r.stderr
    return r.stdout

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("moshi-7b", "qwen2.5-omni-7b", "qwen3-omni-30b-a3b", "minicpm-o-4.5")
GPUS = ("h100", "h200", "b200")
H200_BW, B200_BW, H100_BW = 4.8e12, 8.0e12, 3.35e12
# Moshi's depformer on the H200 (docs/gpu-pricing.md, run 2): 2.27 ms a frame + 7.2 us a session batched with graphs,
# 12.94 ms + 6.1 us eager; one session alone 2.15 ms with graphs, 12.96 ms eager
DEPFORMER_ALONE_EAGER_S = 0.012963919639587403


def _term(terms, prefix):
    (t,) = [t for t in terms if t.name.startswith(prefix)]
    return t


@pytest.mark.parametrize("model", MODELS)
def test_every_model_ships_h100_h200_b200_with_two_stacks_or_more_the_default_first(model):
    for gpu in GPUS:
        c = cal.load(f"{model}-{gpu}")
        assert len(c.stacks) >= 2 and c.stacks[0] == "batched-graphs" and c.stack == "batched-graphs", (model, gpu)
        assert c.engine.num_blocks > 0, (model, gpu)  # a KV pool on every GPU (Qwen3-Omni on an H100: FP8 thinker)
        for s in c.stacks:
            assert c.stack_description(s) and "based on" in c.stack_description(s)


def test_qwen3_omni_on_an_h100_serves_fp8_thinker_weights_and_keeps_a_pool():
    """70 GB of bf16 weights leave an 80 GB H100 nothing at 0.9 utilisation: the preset states FP8 thinker weights,
    which halve the thinker's 61 GB (hand: 80 x 0.9 - (70 - 30.5) - 4 GB of activations = 28.5 GB of pool)."""
    c = cal.load("qwen3-omni-30b-a3b-h100")
    assert any("FP8" in n for n in c.provenance.notes) and "FP8" in c.description
    assert c.engine.num_blocks == int((80e9 * 0.9 - (70e9 - 30.5e9) - 4e9) // (98_304 * 16))


def test_the_stack_prices_moshis_depformer_as_that_stack_runs_it():
    h200 = cal.load("moshi-7b-h200")
    lock = h200.with_stack("vllm-omni-duplex")
    # batched with graphs (the default): one launch a step for every session in it, plus a little per session
    assert _term(h200.step_latency.terms, "depformer: per launch").coefficient == "base_s"
    assert _term(h200.step_latency.terms, "depformer: per launch").value == pytest.approx(2.2665e-3, rel=1e-4)
    # vLLM-Omni duplex: each session's depformer alone, eager, once a frame (one backbone step a frame)
    alone = _term(lock.step_latency.terms, "depformer: per session (one session at a time, eager)")
    assert alone.coefficient == "per_seq_s" and alone.basis == "measured"
    assert alone.value == pytest.approx(DEPFORMER_ALONE_EAGER_S, rel=1e-6)
    assert not [t for t in lock.step_latency.terms if "depformer: per launch" in t.name]
    # the backbone is the same in every stack; the coefficients are the sums of the new terms
    assert lock.backbone_terms == h200.backbone_terms
    assert lock.step_latency.coefficients == pytest.approx(tuple(cal.sum_terms(lock.step_latency.terms).values()),
                                                           rel=1e-12)
    assert lock.step_latency.per_seq_s > h200.step_latency.per_seq_s + 12e-3  # 13 ms a session against 7 us
    # back again: the default as shipped
    assert lock.with_stack("batched-graphs").step_latency.coefficients == pytest.approx(
        h200.step_latency.coefficients, rel=1e-12)
    # the launch-bound part carries to another GPU as it is; the per-session part scales by HBM bandwidth
    b200 = cal.load("moshi-7b-b200")
    assert _term(b200.step_latency.terms, "depformer: per session").value == pytest.approx(
        7.230065e-6 * H200_BW / B200_BW, rel=1e-6)


def test_load_takes_a_stack_by_argument_or_spec_and_refuses_an_unknown_one():
    a = cal.load("qwen3-omni-30b-a3b-h200", stack="vllm-omni")
    b = cal.load("qwen3-omni-30b-a3b-h200@vllm-omni")
    assert a.stack == b.stack == "vllm-omni" and a.step_latency == b.step_latency
    assert a.step_latency.base_s > cal.load("qwen3-omni-30b-a3b-h200").step_latency.base_s  # eager stages
    with pytest.raises(CalibrationError, match=r"no stack 'nope' \(stacks: batched-graphs, vllm-omni\)"):
        cal.load("qwen3-omni-30b-a3b-h200", stack="nope")


def test_a_file_without_stacks_loads_as_before_and_a_bad_stack_field_is_refused():
    d = cal.load("moshi-7b-h200").to_dict()
    plain = copy.deepcopy(d)
    stack_terms = {t["name"] for t in plain.pop("stacks")[0]["terms"]}
    plain.pop("stack")
    c = cal.from_dict(plain)
    assert c.stack == "" and c.stacks == () and c.backbone_terms == c.step_latency.terms
    assert {t.name for t in c.step_latency.terms} >= stack_terms
    with pytest.raises(CalibrationError, match="offers no serving stacks"):
        c.with_stack("vllm-omni-duplex")
    bad = copy.deepcopy(d)
    bad["stack"] = "vllm-omni-duplex"  # its terms are not the ones step_latency lists
    with pytest.raises(CalibrationError, match="field 'stack'"):
        cal.from_dict(bad)
    bad["stack"] = "other"
    with pytest.raises(CalibrationError, match="must be one of the listed stacks"):
        cal.from_dict(bad)
    # a preset's engine given a fitted step model (no terms: what pooling calibrations does) has no stacks left
    from dataclasses import replace

    fitted = replace(cal.load("moshi-7b-h200"), step_latency=cal.StepLatencyModel(4e-3, 1e-5, 1e-7, 0.0))
    assert fitted.stack == "" and fitted.stacks == () and cal.from_dict(fitted.to_dict()).stacks == ()
    # stacks and ranges survive a round trip
    again = cal.from_dict(json.loads(cal.load("moshi-7b-h200").to_json()))
    assert again.stack_options == cal.load("moshi-7b-h200").stack_options


def test_with_term_reprices_every_term_of_that_name_and_resums():
    c = cal.load("moshi-7b-h200")
    name = "depformer: per launch (batched across the step's sessions, CUDA graphs)"
    old = _term(c.step_latency.terms, name).value
    moved = c.with_term(name, 5e-3)
    assert moved.step_latency.base_s == pytest.approx(c.step_latency.base_s - old + 5e-3, rel=1e-12)
    assert _term(moved.stack_pricing("batched-graphs").terms, name).value == 5e-3
    # a plugin term moves the plugin's sums, not the engine's
    sync = "block table copied to the host (the sync)"
    p = c.with_term(sync, 1e-3)
    assert p.step_latency.base_s == c.step_latency.base_s
    sinks = KVPolicy.sinks(16, 16, 368)
    assert p.step_latency_for(sinks).base_s == pytest.approx(c.step_latency_for(sinks).base_s - 1e-3, rel=1e-12)
    # a term of a stack not in use changes that stack only
    other = "depformer: per session (one session at a time, eager)"
    q = c.with_term(other, 1e-3)
    assert q.step_latency == c.step_latency
    assert _term(q.with_stack("vllm-omni-duplex").step_latency.terms, other).value == 1e-3
    with pytest.raises(CalibrationError, match="no term 'nothing'"):
        c.with_term("nothing", 1.0)


def test_terms_for_a_policy_are_the_backbone_the_stack_and_the_plugin_when_it_runs():
    c = cal.load("minicpm-o-4.5-h200")
    names = [t.name for t in c.terms_for(KVPolicy.window(16, 368))]
    assert names == [t.name for t in c.step_latency.terms]
    plugin = [t.name for t in c.terms_for(KVPolicy.sinks(16, 16, 368))]
    assert plugin == names + [t.name for t in c.step_latency.plugin_terms]
    assert len(set(plugin)) == len(plugin)  # one name, one term (the tornado keys on it)


def test_bounds_explicit_else_by_basis():
    est = cal.StepTerm("x", "base_s", 1e-3, "estimated")
    assert est.bounds() == (1e-3 / cal.ESTIMATE_FACTOR, 1e-3 * cal.ESTIMATE_FACTOR) == (0.5e-3, 2e-3)
    assert cal.StepTerm("x", "base_s", 1e-3, "measured").bounds() == (1e-3, 1e-3)
    assert cal.StepTerm("x", "base_s", 1e-3, "estimated", low=0.9e-3, high=1.2e-3).bounds() == (0.9e-3, 1.2e-3)
    # and every datasheet, anchored or measured term of every preset states its range, around its value
    for name in cal.preset_names():
        c = cal.load(name)
        terms = c.step_latency.terms + c.step_latency.plugin_terms + tuple(
            t for s in c.stack_options for t in s.terms)
        for t in terms:
            lo, hi = t.bounds()
            assert lo <= t.value <= hi, (name, t.name)
            if t.basis != "estimated":
                assert t.low is not None and t.high is not None and (lo, hi) != (t.value, t.value), (name, t.name)


def test_a_bad_range_is_refused_and_scaling_keeps_ranges_in_step():
    d = cal.load("moshi-7b-h200").to_dict()
    d["step_latency"]["terms"][0]["low"] = d["step_latency"]["terms"][0]["value"] * 2
    with pytest.raises(CalibrationError, match=r"terms\[0\]\.low': must be <= value"):
        cal.from_dict(d)
    t = cal.load("moshi-7b-h200").step_latency.scaled(2.0).terms[0]
    assert (t.low, t.high) == pytest.approx((2 * 15.4e9 / H200_BW, 2 * 1.42 * 15.4e9 / H200_BW), rel=1e-9)


def test_the_measured_figures_the_roofline_quotes_are_the_files():
    """The depformer's and the MoE's figures in metronome.roofline are those of docs/measured/ (one place to
    update when the measurement is rerun)."""
    import numpy as np

    from metronome import roofline
    from metronome.fit import fit_points

    run2 = json.loads((ROOT / "docs/measured/decode_step-h200-run2.json").read_text())["depformer"]
    for launch, fit in (("graphs", run2["fit"]), ("eager", run2["eager_fit"])):
        d = roofline.DEPFORMER_H200[launch]
        assert d["frame_s"] == pytest.approx(fit["per_frame_s"], rel=1e-6)
        assert d["session_s"] == pytest.approx(fit["per_session_s"], rel=1e-5)
        assert d["spread"] == pytest.approx(fit["fit_max_abs_rel_error"], abs=1e-3)
        one = run2["points"][0]
        assert one["batch"] == 1
        assert d["alone_s"] == pytest.approx(one["frame_s" if launch == "graphs" else "eager_frame_s"], rel=1e-6)
    experts = 48 * 128 * 3 * 2048 * 768 * 2
    for run in (1, 2):
        pts = json.loads((ROOT / f"docs/measured/decode_step-h200-run{run}.json").read_text())["models"]["qwen3-omni"]
        b = np.array([p["batch"] for p in pts["points"]], float)
        coef, _ = fit_points(b, b * [p["context"] for p in pts["points"]], b, [p["step_s"] for p in pts["points"]],
                             8 / 128)
        assert coef["moe_experts_s"] / (experts / H200_BW) == pytest.approx(roofline.MOE_MEASURED_OVER_DATASHEET,
                                                                             rel=0.02)


# ------------------------------------------------------------------------------------------------ the CLI


def test_calibrations_lists_three_gpus_per_model_with_their_stacks():
    out = run_cli(["calibrations"], columns=220)
    for m in MODELS:
        for g in GPUS:
            line = next(x for x in out.splitlines() if x.startswith(f"{m}-{g} "))
            assert "batched-graphs," in line, line
    assert "vllm-omni-duplex" in out and "vllm-omni" in out


def test_calibrations_terms_prints_each_term_with_its_basis_range_and_source():
    out = run_cli(["calibrations", "--terms", "moshi-7b-h200", "--stack", "vllm-omni-duplex"], columns=400)
    assert "stack vllm-omni-duplex:" in out and "RFC #7389" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("depformer: per session (one session at a time"))
    assert "13 ms per sequence" in line and "measured" in line and "range 12.6 ms–13.4 ms" in line
    assert "decode_step-h200-run2.json" in out
    assert "plugin terms" in out and "eager mode, no CUDA graphs" in out


@pytest.mark.parametrize("argv", [
    ["capacity", "--calibration", "moshi-7b-h200", "--stack", "nope"],
    ["run", "--calibration", "moshi-7b-h200", "--stack", "nope", "--sessions", "1", "--horizon", "1"],
    ["what-if", "--calibration", "moshi-7b-h200,moshi-7b-b200", "--stack", "nope", "--sessions", "1", "--horizon", "1"],
    ["fleet", "--calibration", "moshi-7b-h200", "--stack", "nope", "--arrival-rate", "1"],
    ["report", "--calibration", "moshi-7b-h200", "--stack", "nope", "--out", "unused-report"],
    ["calibrations", "--terms", "moshi-7b-h200", "--stack", "nope"],
])
def test_an_unknown_stack_is_one_line_and_exit_2(argv, capsys, tmp_path, monkeypatch):
    from metronome.cli.sim_cli import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "has no stack 'nope' (stacks: batched-graphs, vllm-omni-duplex)" in err


def test_probe_run_takes_the_stack_with_its_calibration(capsys):
    from metronome.cli.probe_cli import main

    argv = ["run", "--target", "ws://127.0.0.1:9", "--arrival-rate", "1", "--horizon", "1",
            "--calibration", "moshi-7b-h200", "--stack", "nope"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "has no stack 'nope'" in err


def test_the_stack_flag_reaches_the_answer():
    """--stack prices the run: the vllm-omni-duplex stack's per-session eager depformer (13 ms a session a frame)
    leaves an 80 ms frame a handful of sessions where the default carries hundreds."""
    default = run_cli(["capacity", "--calibration", "moshi-7b-h200", "--kv", "window", "--window", "368"])
    lock = run_cli(["capacity", "--calibration", "moshi-7b-h200", "--kv", "window", "--window", "368",
                    "--stack", "vllm-omni-duplex"])

    def n_star(out):
        line = next(x for x in out.splitlines() if x.strip().startswith("deadline-bound N*"))
        return int(line.split()[2].replace(",", ""))

    assert n_star(lock) <= 80e-3 * 0.8 / DEPFORMER_ALONE_EAGER_S < 10 < 100 < n_star(default)


def test_an_unmeasured_stage_pays_the_measured_launch_floor_a_layer_as_its_stack_runs_it():
    """Stages not measured yet launch their layers at the depformer's measured cost a layer (2.2665 ms with graphs,
    12.943 ms eager, over 8 steps x 6 layers): batched once a step (base), one session at a time once a session."""
    graphs, eager = 2.2665444e-3 / 48, 12.943370e-3 / 48
    q3 = cal.load("qwen3-omni-30b-a3b-h200", stack="vllm-omni").step_latency
    # the code predictor: 15 passes x 12.5 Hz, 1 s frame over 2 backbone steps = 93.75 passes a step, 5 layers, eager
    cp = _term(q3.terms, "code predictor: per launch")
    assert cp.coefficient == "base_s" and cp.value == pytest.approx(93.75 * 5 * eager, rel=1e-6)
    assert cp.basis == "estimated" and cp.bounds() == pytest.approx((cp.value / 2, cp.value * 2))
    # the audio encoder: one call a frame, over 2 steps, 32 layers
    enc = _term(cal.load("qwen3-omni-30b-a3b-h200").step_latency.terms, "audio encoder: per launch")
    assert enc.value == pytest.approx(0.5 * 32 * graphs, rel=1e-6)
    # Mimi one session at a time, eager: 2 passes a frame (one step), 12 layers each, every session
    lock = cal.load("moshi-7b-h200", stack="vllm-omni-duplex").step_latency
    mimi = _term(lock.terms, "Mimi encoder + decoder: launches per session")
    assert mimi.coefficient == "per_seq_s" and mimi.value == pytest.approx(2 * 12 * eager, rel=1e-6)
    # MiniCPM-o's TTS LM keeps its graphs in the vllm-omni stack (talker enforce_eager: false)
    tts = _term(cal.load("minicpm-o-4.5-h200", stack="vllm-omni").step_latency.terms, "TTS LM: per launch")
    assert "CUDA graphs" in tts.name and tts.value == pytest.approx(25 * 1.0 / 8 * 24 * graphs, rel=1e-6)


def test_the_h100_is_the_sxm_80gb():
    from metronome.roofline import GPUS

    g = GPUS["h100"]
    assert (g.memory_bytes, g.hbm_bytes_per_s, g.bf16_flops, g.pcie_bytes_per_s) == (80e9, 3.35e12, 989e12, 64e9)
    # Moshi's pool on it: (80 GB x 0.9 - 15.4 GB of weights - 4 GB) / (512 KiB x 16 a block)
    assert cal.load("moshi-7b-h100").engine.num_blocks == int((80e9 * 0.9 - 15.4e9 - 4e9) // (524_288 * 16))
