"""The MoE step: a step of n tokens reads E·(1 − (1 − k/E)^n) of its backbone's experts (metronome.calibration
step_inputs), checked against Qwen3-Omni's decode step measured on an H200 (docs/measured/decode_step-h200-run*.json),
and the simulator's compiled loop prices it as the step model does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from metronome import calibration as cal
from metronome.fit import fit_points

ROOT = Path(__file__).resolve().parent.parent
ROUTE = 8 / 128  # Qwen3-Omni's thinker: 8 of 128 experts a token
MOE = cal.COEFFICIENTS.index("moe_experts_s")  # (its place among step_inputs)
MAX_ERROR = 0.15  # the bar for the step model over the measured batch grid


def _measured(run: int, backbone: str = "qwen3-omni"):
    pts = json.loads((ROOT / f"docs/measured/decode_step-h200-run{run}.json").read_text())["models"][backbone]
    b = np.array([p["batch"] for p in pts["points"]], float)
    c = np.array([p["context"] for p in pts["points"]], float)
    return b, c, np.array([p["step_s"] for p in pts["points"]], float)


def test_the_share_of_experts_a_step_reads():
    # hand arithmetic: one token reads 8 of 128; two read 1 - (120/128)^2 = 0.12109375 of them; a prefill reads all
    x = cal.step_inputs(1, 0, 1, ROUTE)[MOE]
    assert x == pytest.approx(8 / 128, rel=1e-12)
    assert cal.step_inputs(2, 0, 2, ROUTE)[MOE] == pytest.approx(1 - (120 / 128) ** 2, rel=1e-12)
    assert cal.step_inputs(1, 0, 4096, ROUTE)[MOE] == pytest.approx(1.0, abs=1e-12)
    assert cal.step_inputs(64, 0, 64, 0.0)[MOE] == 0.0  # dense


@pytest.mark.parametrize("run", [1, 2])
def test_the_step_model_follows_the_measured_moe_curve(run):
    """One fit over the whole measured grid (batch 1..256 x context 512..8,192) misses no point by more than 15%
    (5.2-5.4% measured). Without the mean sequence's context (the batch-1 step waits on one sequence's KV read)
    the same fit misses batch 1 at 8,192 by 25%; a step model linear in batch (no MoE input) misses by more."""
    b, c, y = _measured(run)
    assert sorted(set(b)) == [1, 8, 32, 64, 128, 256] and sorted(set(c)) == [512, 2048, 8192]
    _, err = fit_points(b, b * c, b, y, ROUTE)
    assert np.abs(err).max() <= MAX_ERROR, np.abs(err).max()
    _, lin = fit_points(b, b * c, b, y, 0.0)
    assert np.abs(lin).max() > 2 * MAX_ERROR, np.abs(lin).max()


@pytest.mark.parametrize("run", [1, 2])
@pytest.mark.parametrize("backbone", ["moshi", "qwen2.5-omni", "minicpm-o"])
def test_the_step_model_follows_each_dense_backbones_measured_grid(run, backbone):
    """The dense backbones too: one fit over the grid within 15% (2.1-14.8% measured; 28.9-32.0% for Qwen2.5-Omni
    and MiniCPM-o without the mean-context input, whose batch-1 steps wait on one sequence's read of 4 or 8 KV
    heads; Moshi's 32 KV heads fill the GPU, and its coefficient fits to about 0)."""
    b, c, y = _measured(run, backbone)
    coef, err = fit_points(b, b * c, b, y, 0.0)
    assert np.abs(err).max() <= MAX_ERROR, np.abs(err).max()
    assert coef["moe_experts_s"] == 0.0


def test_the_presets_mean_context_term_is_the_measured_fit():
    """The roofline's constant (metronome.roofline.MEAN_CONTEXT_H200_S) is what the step model's fit to each
    measured grid gives (0.5 ns: the constant is written to 5 digits)."""
    from metronome.roofline import MEAN_CONTEXT_H200_S

    for backbone, runs in MEAN_CONTEXT_H200_S.items():
        for run, want in zip((1, 2), runs):
            b, c, y = _measured(run, backbone)
            coef, _ = fit_points(b, b * c, b, y, ROUTE if backbone == "qwen3-omni" else 0.0)
            assert coef["per_mean_context_token_s"] == pytest.approx(want, abs=0.5e-9), (backbone, run)
    h200 = cal.load("qwen3-omni-30b-a3b-h200").step_latency
    assert h200.per_mean_context_token_s == pytest.approx(sum(MEAN_CONTEXT_H200_S["qwen3-omni"]) / 2, rel=1e-12)
    # a batch-1 step over 8,192 tokens waits on the whole read; 256 sequences of 8,192 on one of them
    assert h200.step_s(1, 8192, 1) - h200.step_s(1, 0, 1) == pytest.approx(
        8192 * (h200.per_context_token_s + h200.per_mean_context_token_s), rel=1e-9)
    assert h200.step_s(256, 256 * 8192, 256) - h200.step_s(256, 0, 256) == pytest.approx(
        8192 * (256 * h200.per_context_token_s + h200.per_mean_context_token_s), rel=1e-9)
    assert cal.step_inputs(0, 0, 0, ROUTE)[-1] == 0.0  # an empty step has no mean sequence


def test_a_dense_fit_leaves_the_moe_coefficient_at_zero():
    """A dense backbone's MoE input is 0 at every point: its coefficient is 0 and the rest fit as they did."""
    b = np.array([1, 8, 32, 64, 128, 256, 1, 8, 32, 64, 128, 256], float)
    ctx = b * np.repeat([512.0, 4096.0], 6)
    y = 4e-3 + 1e-5 * b + 1e-7 * ctx  # a made-up dense step: 4 ms + 10 us a sequence + 100 ns a context token
    from metronome.fit import design_matrix

    assert not design_matrix(b, ctx, b, 0.0)[:, MOE].any()  # the MoE column: 0 everywhere
    coef, err = fit_points(b, ctx, b, y, 0.0)
    assert coef["moe_experts_s"] == 0.0 and np.abs(err).max() < 1e-9
    assert coef["base_s"] == pytest.approx(4e-3, rel=1e-6)
    assert coef["per_context_token_s"] == pytest.approx(1e-7, rel=1e-6)


def test_qwen3_omnis_preset_prices_the_experts_a_step_reads():
    sl = cal.load("qwen3-omni-30b-a3b-h200").step_latency
    experts = 48 * 128 * 3 * 2048 * 768 * 2 / 4.8e12  # all routed experts at datasheet bandwidth
    assert sl.moe_route == ROUTE and sl.moe_experts_s == pytest.approx(experts, rel=1e-9)
    # a batch-1 decode step reads 1/16 of them; a batch-256 one all but (120/128)^256 of them
    one, many = sl.step_s(1, 0, 1), sl.step_s(256, 0, 256)
    no_moe = lambda n: sl.base_s + n * (sl.per_seq_s + sl.per_new_token_s)  # noqa: E731
    assert one - no_moe(1) == pytest.approx(experts / 16, rel=1e-9)
    assert many - no_moe(256) == pytest.approx(experts * (1 - (120 / 128) ** 256), rel=1e-9)
    # a dense model has no MoE term at all (and its file does not list one)
    dense = cal.load("moshi-7b-h200")
    assert dense.step_latency.moe_route == 0.0 and "moe_route" not in dense.to_dict()["step_latency"]


def test_the_compiled_loop_prices_the_moe_step_as_the_model_does():
    """Every step the simulator takes (the compiled loop fast-forwards most of them) costs the step model's time for
    its batch, context and tokens: with the MoE input, not without it."""
    from metronome.sim.scenario import make_scenario, run

    c = cal.load("qwen3-omni-30b-a3b-h200")
    res = run(make_scenario(c, sessions=24, ramp_s=3.0, horizon=12.0, seed=1))
    st = res.steps
    assert res.fast_steps > 0 and len(st) > 20
    want = c.step_latency.step_s(st.batch.to_numpy(float), st.context_tokens.to_numpy(float),
                                 st.new_tokens.to_numpy(float))
    assert np.allclose(st.step_s.to_numpy(float), want, rtol=1e-12, atol=0)
