"""A fixed engine for the tests of the simulator's behaviour (the cliff, the bound, AIMD), so that they do not
move when the shipped presets are repriced: the Moshi 7B / H200 pool with a plain roofline step model (2 ms a
step, the weights and the KV read at 4.8 TB/s, 20 us a sequence, 2·7.7e9 FLOP a token at half of 989 TFLOP/s),
no frame pipeline and no plugin costs. Fast enough that hundreds of sessions meet an 80 ms deadline, which the
priced presets (tests/test_calibration.py) do not allow."""

from dataclasses import replace
from pathlib import Path

from metronome import calibration
from metronome.calibration import StepLatencyModel


def fast_moshi() -> calibration.Calibration:
    c = calibration.load("moshi-7b-h200")
    step = StepLatencyModel(base_s=2e-3 + 15.4e9 / 4.8e12, per_seq_s=2e-5, per_context_token_s=524_288 / 4.8e12,
                            per_new_token_s=2 * 7.7e9 / (989e12 * 0.5), fitted_range=c.step_latency.fitted_range)
    return replace(c, name="moshi-7b-h200-fast", step_latency=step)


def write_fast_moshi(folder: Path) -> Path:
    p = Path(folder) / "moshi-7b-h200-fast.json"
    p.write_text(fast_moshi().to_json())
    return p


def slow_moshi() -> calibration.Calibration:
    """The Moshi 7B / H200 pool with the step model its preset had before serving stacks (issue 47): N* 122, and
    an engine that falls behind the stream's clock past about 180 sessions, which the tests of the fill model past
    the throughput need. Its terms: the weights and the KV read at 4.8 TB/s, vLLM's anchored 5.1 ms Llama 8B step
    less its weights at 3.35 TB/s, 20 us a sequence plus 10 speech passes (8 depformer, 2 Mimi) at Qwen3-Omni's
    anchored cost a pass (0.178 s / 16 streams / 212.5 passes a second, scaled 3.35 -> 4.8 TB/s), 2·7.7e9 FLOP a
    token at half of 989 TFLOP/s."""
    c = calibration.load("moshi-7b-h200")
    step = StepLatencyModel(base_s=15.4e9 / 4.8e12 + (5.1e-3 - 16.06e9 / 3.35e12),
                            per_seq_s=2e-5 + 10 * (0.578 - 0.400) / 16 / 212.5 * 3.35e12 / 4.8e12,
                            per_context_token_s=524_288 / 4.8e12, per_new_token_s=2 * 7.7e9 / (989e12 * 0.5),
                            fitted_range=c.step_latency.fitted_range)
    return replace(c, name="moshi-7b-h200-slow", step_latency=step)


def write_slow_moshi(folder: Path) -> Path:
    p = Path(folder) / "moshi-7b-h200-slow.json"
    p.write_text(slow_moshi().to_json())
    return p
