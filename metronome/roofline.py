"""Estimated calibrations: pool size and step latency from datasheet numbers, published measurements and this
project's own GPU measurements (docs/measured/).

Used to build the ``estimated`` presets in ``calibration/``, one per model of :data:`metronome.models.MODELS`
and GPU of :data:`GPUS` (``python -m metronome.roofline`` rewrites them; a test checks the shipped files match).
Every coefficient of the step-latency model is a sum of named terms (:class:`~metronome.calibration.StepTerm`),
each with its value, its range, its basis and its source, written into the preset; ``metronome-sim calibrations
--terms NAME`` and the report print them. The live probe replaces all of it with a ``measured`` calibration.

* KV bytes per token = 2·layers·kv_heads·head_dim·dtype_bytes; pool blocks =
  floor((memory·utilisation − weights − activation reserve) / bytes per block) (:func:`weights`: what a deployment
  does where bf16 weights leave no pool).
* The backbone vLLM serves (decode is memory-bound, prefill compute-bound): its dense weights stream once per
  step, an MoE backbone's routed experts by the share a step reads (``moe_experts_s``), attention reads the
  resident KV, each computed token costs 2·active params of matmul work, and vLLM itself costs a little per step
  and per sequence (:data:`ANCHORS`: a batch-1 decode with CUDA graphs).
* The rest of the frame pipeline on the same GPU (:class:`~metronome.models.Stage`), priced for each serving stack
  the model ships (:data:`metronome.models.STACKS`; :func:`stage_terms`): batched across a step's sessions or one
  session at a time, with CUDA graphs or eager. Moshi's depformer as measured on an H200; the other stages'
  launches from the depformer's measured cost a layer, their work per session from vLLM-Omni's Qwen3-Omni
  measurement (speech passes) or their matmuls (encoders). The preset's step model is priced for the first stack
  (the default); the others ride along in the file (``stacks``).
* The sink+window plugin's own costs (:attr:`~metronome.kv_policy.KVPolicy.runs_plugin`) are
  ``plugin_terms``: eager mode (no CUDA graphs), the per-step block-table copy to the host and the sync it
  forces, and the compaction's own Python per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from metronome.calibration import (Calibration, EnginePool, Provenance, StackPricing, StepLatencyModel, StepTerm,
                                   sum_terms)
from metronome.models import (BATCHED, EAGER, GRAPHS, MODELS, QWEN3_OMNI_SPEECH_PASSES_PER_S, STACKS, Mode, Model,
                              Stage)


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    memory_bytes: float  # usable device memory
    hbm_bytes_per_s: float
    bf16_flops: float  # dense peak
    pcie_bytes_per_s: float  # host link, one direction
    source: str


GPUS = {
    "h100": GPU("h100", "NVIDIA H100 SXM (80 GB HBM3)", 80e9, 3.35e12, 989e12, 64e9,
                "vendor datasheet: 80 GB, 3.35 TB/s, 989 TFLOP/s dense bf16, PCIe Gen5 x16 (64 GB/s)"),
    "h200": GPU("h200", "NVIDIA H200 SXM (141 GB HBM3e)", 141e9, 4.8e12, 989e12, 64e9,
                "vendor datasheet: 141 GB, 4.8 TB/s, 989 TFLOP/s dense bf16, PCIe Gen5 x16 (64 GB/s)"),
    "b200": GPU("b200", "NVIDIA B200 (≈180 GB usable HBM3e)", 180e9, 8.0e12, 2250e12, 64e9,
                "vendor datasheet: 192 GB physical (≈180 GB exposed per GPU on HGX B200), 8 TB/s, 2.25 PFLOP/s "
                "dense bf16, PCIe Gen5 x16 (64 GB/s)"),
}

# Published measurements the estimates lean on. Each figure is quoted with where it comes from; what is derived
# from it is computed below, so the arithmetic can be checked by hand.
H100_HBM_BYTES_PER_S = 3.35e12  # H100 SXM datasheet: the GPU the anchors were measured on
LLAMA_8B_BYTES = 16.06e9  # Llama 3.1 8B bf16 weights
ANCHORS = {
    "graph": (5.1e-3, "Llama 3.1 8B, one H100 SXM5, batch-1 decode step with CUDA graphs: 5.1 ms "
                      "(cloudai.pt, 'CUDA Graphs + torch.compile: 1.65x LLM Decode Speedup')"),
    "eager": (8.4e-3, "the same decode step in eager mode: 8.4 ms (same source)"),
    "host_sync": (2e-3, "a blocking device-to-host copy in a decode step stalls the step ~2 ms while the queued "
                        "kernels drain (vllm-project/vllm-omni PR #1985, Qwen3-TTS talker)"),
    # vLLM-Omni's CI perf baselines for Qwen3-Omni-30B-A3B on two H100s, the thinker on one and the talker and
    # Code2Wav on the other (vllm-project/vllm-omni PR #3695, random 2500 tokens in / 900 out, audio out): mean audio
    # real-time factor 0.400 at 16 concurrent requests, 0.578 at 32. One more stream costs (0.578 − 0.400) / 16 s of
    # the speech GPU's time per second of speech.
    "speech": ((0.578 - 0.400) / 16, "Qwen3-Omni under vLLM-Omni, its speech stages on an H100 of their own: audio "
                                     "RTF 0.400 at 16 concurrent requests, 0.578 at 32 (vllm-project/vllm-omni PR "
                                     "#3695 perf baselines)"),
}
LLAMA_8B_LAYERS = 32

# Measured on one H200 (docs/measured/, docs/gpu-pricing.md; tests/test_stacks.py reads the files back against these).
MEASURED_GPU = "h200"
# Moshi's depformer (decode_step-h200-run2.json, "depformer": 8 sequential steps x 6 layers a frame, random bf16
# weights, plain PyTorch, PyTorch 2.11.0+cu130, driver 580.159.04, 2026-12-04): a frame for B sessions batched is
# frame_s + B x session_s (fit over B = 1..256, its max error the spread), and one session alone takes alone_s.
DEPFORMER_H200 = {
    GRAPHS: {"frame_s": 2.2665444e-3, "session_s": 7.230065e-6, "alone_s": 2.1537760e-3, "spread": 0.0557},
    EAGER: {"frame_s": 12.943370e-3, "session_s": 6.075790e-6, "alone_s": 12.963920e-3, "spread": 0.0316},
}
DEPFORMER_PASSES_PER_FRAME, DEPFORMER_LAYERS = 8, 6
DEPFORMER_SOURCE = ("docs/measured/decode_step-h200-run2.json (depformer of Moshi's shape, random bf16 weights, plain "
                    "PyTorch 2.11.0+cu130, driver 580.159.04, one H200, 2026-12-04)")
# Qwen3-Omni's decode step over batch 1..256 x context 512..8,192 (decode_step-h200-run1/-run2.json, "qwen3-omni"):
# the step model's MoE coefficient fitted to it is 19.8 ms in both runs, 1.64x the 58.0 GB of routed experts at
# datasheet bandwidth (12.1 ms): the top of the MoE term's range
MOE_MEASURED_OVER_DATASHEET = 1.64
# The same runs, every backbone: one sequence's own KV read, per context token of a step's mean sequence (the step
# model's per_mean_context_token_s), fitted with the whole step model over the grid, (run 1, run 2) in seconds. The
# probe's attention (PyTorch SDPA over contiguous KV) spreads a sequence over its KV heads only, so a batch-1 step
# over 8,192 tokens waits on that read: Qwen3-Omni's 4 KV heads read at about 1/24 of the bandwidth, Moshi's 32
# fill the GPU (its fit is 0 and 22 ns, noise). vLLM's decode kernels also split one sequence's KV along the
# context, so a serving engine may wait on it less: the term's range goes down to 0.
MEAN_CONTEXT_H200_S = {"moshi": (0.0, 22.29e-9), "qwen2.5-omni": (218.75e-9, 201.97e-9),
                       "qwen3-omni": (442.84e-9, 442.53e-9), "minicpm-o": (239.06e-9, 265.42e-9)}
# the same runs: weights stream at 1.20-1.42x datasheet time and attention reads the KV at 1.02-1.10x (dense
# backbones, plain PyTorch at batch 1); eager mode costs 41-108 us a layer more than graphs on the dense backbones,
# 303-458 us on the MoE; Moshi's batch-256 step spends 9.4 us a token outside attention where the presets charge 31
WEIGHTS_MEASURED_OVER_DATASHEET = 1.42
KV_MEASURED_OVER_DATASHEET = 1.10
EAGER_PER_LAYER_MEASURED_S = {"dense": (41e-6, 108e-6), "moe": (303e-6, 458e-6)}
MATMUL_MEASURED_OVER_CHARGED = 9.4 / 31
# A launch-bound cost follows the host, the driver and kernel latency, not HBM bandwidth: a figure measured on the
# H200 is carried to another GPU as it is, and its range widens to this factor either way (the same eager code's
# cost a layer varied 2.6x between two runs on one H200); a per-session cost (work on the session's data) scales
# by HBM bandwidth, with the same widening.
OTHER_GPU_FACTOR = 1.5

# Assumptions shared by every estimate (each is written into the preset's notes).
GPU_MEMORY_UTILISATION = 0.9
ACTIVATION_RESERVE_BYTES = 4e9
BLOCK_SIZE_TOKENS = 16
MAX_NUM_BATCHED_TOKENS = 8192
PER_SEQ_OVERHEAD_S = 2e-5
MFU = 0.5
COMPACTION_PER_REQUEST_S = 12.6e-6  # benchmarks/bench_compaction.py on the development machine (README)
BLOCK_TABLE_ENTRY_BYTES = 4  # int32
SPEECH_ANCHOR_RANGE = (0.5, 1.5)  # the speech anchor's range, as factors of it (step_terms says why)

# What a deployment does where the model as the table states it does not fit the GPU with a KV pool: Qwen3-Omni's
# 70 GB of bf16 weights leave an 80 GB H100 nothing at 0.9 utilisation, so the H100 preset serves the thinker's
# weights in FP8 (vLLM's online quantization, --quantization fp8): its streamed bytes and experts halve, the talker,
# encoder and codec stay bf16, the KV stays bf16, and the matmul work is still priced at the bf16 rate (conservative).
FP8_THINKER = {("qwen3-omni-30b-a3b", "h100")}


def weights(m: Model, g: GPU) -> tuple[float, float, float, str]:
    """(resident, streamed per step, routed experts) weight bytes of ``m`` as deployed on ``g``, and what the
    deployment does."""
    if (m.key, g.key) in FP8_THINKER:
        saved = m.streamed_weight_bytes / 2
        return (m.weight_bytes - saved, m.streamed_weight_bytes / 2, m.expert_bytes / 2,
                "FP8 thinker weights (vLLM --quantization fp8): bf16 weights leave no KV pool on this GPU")
    return m.weight_bytes, m.streamed_weight_bytes, m.expert_bytes, "bf16 weights"


def vllm_step_s() -> float:
    """vLLM's own cost of a step beyond streaming the weights (scheduling, sampling, graph launch, kernel
    tails): the anchored batch-1 step less the weights at datasheet bandwidth."""
    return ANCHORS["graph"][0] - LLAMA_8B_BYTES / H100_HBM_BYTES_PER_S


def eager_per_layer_s() -> float:
    """What eager mode adds per layer per step: the anchored eager step less the CUDA-graph step."""
    return (ANCHORS["eager"][0] - ANCHORS["graph"][0]) / LLAMA_8B_LAYERS


def pass_s(gpu: GPU) -> float:
    """GPU time of one sequential forward pass of a small speech-side model, per session: Qwen3-Omni's anchored
    speech cost spread over its passes, scaled from the H100 by HBM bandwidth."""
    return ANCHORS["speech"][0] / QWEN3_OMNI_SPEECH_PASSES_PER_S * H100_HBM_BYTES_PER_S / gpu.hbm_bytes_per_s


def launch_per_layer_s(launch: str) -> float:
    """What one small layer's launch costs a pass (graphs or eager), whatever the batch: Moshi's depformer frame,
    measured on the H200, over its 48 sequential layers."""
    return DEPFORMER_H200[launch]["frame_s"] / (DEPFORMER_PASSES_PER_FRAME * DEPFORMER_LAYERS)


def _measured_range(value: float, spread: float, g: GPU) -> dict:
    if g.key == MEASURED_GPU:
        return {"low": value * (1 - spread), "high": value * (1 + spread)}
    return {"low": value / OTHER_GPU_FACTOR, "high": value * OTHER_GPU_FACTOR}


def units_per_step(units_per_frame: float, steps_per_frame: int) -> float:
    """How many of a stage's units (passes, frames, chunks, calls) one backbone step carries: a session takes
    ``steps_per_frame`` (``output_tokens_per_frame``) backbone steps a frame, and the stage runs
    ``units_per_frame`` of its units in that frame."""
    return units_per_frame / steps_per_frame


def fold_stage(units: float, duty: float, per_launch_s: float, per_session_s: float) -> tuple[float, float]:
    """``(base_s, per_seq_s)``: what a stage costing ``per_launch_s + per_session_s·B`` a unit for the B sessions
    of a step adds to that step when the step carries ``units`` of its units (:func:`units_per_step`). The launch
    is paid whenever any session runs the stage (at hundreds of sessions, all the time: ``base_s``); each session's
    part only for the ``duty`` share of the conversation it runs the stage (``per_seq_s``). The one statement of
    it: the estimated stages here and the measured ones (:func:`metronome.probe.stage_timers.stage_terms`)."""
    return units * per_launch_s, units * duty * per_session_s


def folded_stage_terms(st: Stage, mode: Mode, launch: tuple[float, float, float],
                       session: tuple[float, float, float], basis: str, source: str) -> tuple[StepTerm, StepTerm]:
    """A stage's two terms from what :func:`fold_stage` made of it, each ``(value, low, high)``: its launch part
    per step and its per-session part per sequence (the range widened to hold the value)."""
    return tuple(StepTerm(f"{st.name}: {what} ({mode.label})", coefficient, v, basis, source,
                          low=min(lo, v), high=max(hi, v))
                 for what, coefficient, (v, lo, hi) in (("per launch", "base_s", launch),
                                                        ("per session", "per_seq_s", session)))


def _measured_stage_terms(m: Model, st: Stage, mode: Mode, g: GPU) -> tuple[StepTerm, ...]:
    """Moshi's depformer as measured (:data:`DEPFORMER_H200`)."""
    frames = units_per_step(st.rate * m.stream.frame_period_s, m.stream.output_tokens_per_frame) \
        / DEPFORMER_PASSES_PER_FRAME
    d = DEPFORMER_H200[mode.launch]
    bw = GPUS[MEASURED_GPU].hbm_bytes_per_s / g.hbm_bytes_per_s
    where = "" if g.key == MEASURED_GPU else (
        f"; measured on the H200: the launch-bound part carried as it is, the per-session part scaled by HBM "
        f"bandwidth (x {bw:.3g}), range x/{OTHER_GPU_FACTOR:g}..x{OTHER_GPU_FACTOR:g}")
    label = mode.label
    if mode.batching == BATCHED:
        launch, per = fold_stage(frames, st.duty, d["frame_s"], d["session_s"])
        per *= bw  # (the per-session work scales with HBM bandwidth; the launches do not)
        return (
            StepTerm(f"{st.name}: per launch ({label})", "base_s", launch, "measured",
                     f"{st.source}; {frames:g} frame a step x {d['frame_s'] * 1e3:.4g} ms a frame for any batch "
                     f"({DEPFORMER_SOURCE}; range: the fit's max error, {d['spread']:.1%}){where}",
                     **_measured_range(launch, d["spread"], g)),
            StepTerm(f"{st.name}: per session ({label})", "per_seq_s", per, "measured",
                     f"{frames:g} frame a step x {d['session_s'] * 1e6:.3g} us per session a frame ({DEPFORMER_SOURCE})"
                     f"{where}", **_measured_range(per, d["spread"], g)),
        )
    alone = fold_stage(frames, st.duty, 0.0, d["alone_s"])[1]
    return (StepTerm(f"{st.name}: per session ({label})", "per_seq_s", alone, "measured",
                     f"{st.source}; {frames:g} frame a step x {d['alone_s'] * 1e3:.4g} ms, one session's frame alone "
                     f"({DEPFORMER_SOURCE}; range: the batched fit's max error, {d['spread']:.1%}){where}",
                     **_measured_range(alone, d["spread"], g)),)


MEASURED_STAGES = {("moshi-7b", "depformer"): _measured_stage_terms}


def stage_terms(m: Model, st: Stage, mode: Mode, g: GPU) -> tuple[StepTerm, ...]:
    """The terms ``st`` adds to a backbone step when a stack runs it in ``mode``.

    A stage runs for the sessions in a backbone step: a session takes ``output_tokens_per_frame`` steps a frame, so
    a step carries ``rate × frame period / steps a frame`` of its passes (an encoder: one call per frame, so
    ``1 / steps a frame``). Each pass launches ``layers`` small layers, whose cost is the launch floor measured on
    Moshi's depformer (:func:`launch_per_layer_s`, graphs or eager) whatever the batch: batched, one launch serves
    the step's sessions (``base_s``, whenever any of them runs the stage); one session at a time, every session
    pays it (``per_seq_s``, for its ``duty``). The work on each session's data is a ``per_seq_s`` term in either
    mode: speech passes priced from the anchor (:func:`pass_s`), encoders by their matmul work."""
    if (m.key, st.name) in MEASURED_STAGES:
        return MEASURED_STAGES[m.key, st.name](m, st, mode, g)
    steps = m.stream.output_tokens_per_frame
    period = m.stream.frame_period_s
    passes = units_per_step(st.rate * period if st.kind == "decode" else 1.0, steps)
    floor = st.layers * launch_per_layer_s(mode.launch)
    how_floor = (f"{passes:g} {'passes' if st.kind == 'decode' else 'calls'} a step x {st.layers} layers x "
                 f"{launch_per_layer_s(mode.launch) * 1e6:.1f} us a layer ({mode.launch}: Moshi's depformer frame "
                 f"measured on the H200, {DEPFORMER_H200[mode.launch]['frame_s'] * 1e3:.3g} ms over "
                 f"{DEPFORMER_PASSES_PER_FRAME * DEPFORMER_LAYERS} layers; launch-bound, carried to every GPU as it "
                 f"is)")
    if mode.batching == BATCHED:
        launch = StepTerm(f"{st.name}: per launch ({mode.label})", "base_s",
                          fold_stage(passes, st.duty, floor, 0.0)[0], "estimated", how_floor)
    else:
        launch = StepTerm(f"{st.name}: launches per session ({mode.label})", "per_seq_s",
                          fold_stage(passes, st.duty, 0.0, floor)[1], "estimated", f"{st.duty:g} duty x {how_floor}")
    if st.kind == "decode":
        anchored = st.name in ("talker", "code predictor", "Code2Wav") and m.key == "qwen3-omni-30b-a3b"
        value = fold_stage(passes, st.duty, 0.0, pass_s(g))[1]
        how = (f"{st.duty:g} duty x {st.rate:g} passes/s x {pass_s(g) * 1e6:.1f} us per pass per session "
               f"(anchor: {ANCHORS['speech'][1]}; spread over {QWEN3_OMNI_SPEECH_PASSES_PER_S:g} passes/s, "
               f"scaled by HBM bandwidth from the H100)")
        rng = ({"low": value * SPEECH_ANCHOR_RANGE[0], "high": value * SPEECH_ANCHOR_RANGE[1]} if anchored else {})
        if anchored:
            how += (f"; range x{SPEECH_ANCHOR_RANGE[0]:g}..x{SPEECH_ANCHOR_RANGE[1]:g}: a slope between two rounded "
                    f"means, and it holds the thinker's share of each added stream, which the backbone terms also "
                    f"charge")
        work = StepTerm(f"{st.name}: work per session", "per_seq_s", value, "anchored" if anchored else "estimated",
                        f"{st.source}; {how}; x {period:g} s frame / {steps} backbone steps per frame", **rng)
    else:
        positions = units_per_step(st.rate * period, steps)
        value = fold_stage(positions, st.duty, 0.0, 2 * st.params / (g.bf16_flops * MFU))[1]
        work = StepTerm(f"{st.name}: work per session", "per_seq_s", value, "estimated",
                        f"{st.source}; {st.duty:g} duty x {st.rate:g} positions/s x 2 x {st.params / 1e9:g}e9 params / "
                        f"({g.bf16_flops / 1e12:g} TFLOP/s x {MFU} MFU); x {period:g} s frame / {steps} backbone "
                        f"steps per frame")
    return (launch, work)


def stack_pricings(m: Model, g: GPU) -> tuple[StackPricing, ...]:
    """Each of the model's stacks (:data:`metronome.models.STACKS`) priced on ``g``."""
    return tuple(StackPricing(name=sk.name, description=sk.description, source=sk.source,
                              terms=tuple(t for st in m.pipeline for t in stage_terms(m, st, sk.mode(st.name), g)))
                 for sk in STACKS[m.key])


def _mean_context_term(m: Model, g: GPU) -> StepTerm:
    """One sequence's own KV read (:data:`MEAN_CONTEXT_H200_S`): the mean of the two H200 runs, carried to another
    GPU by HBM bandwidth as a per-session cost is (:data:`OTHER_GPU_FACTOR` widening its top); from 0 (a kernel
    that splits the sequence over the GPU) to the higher run."""
    runs = MEAN_CONTEXT_H200_S[m.probe_name]
    bw = GPUS[MEASURED_GPU].hbm_bytes_per_s / g.hbm_bytes_per_s
    value, high = sum(runs) / len(runs) * bw, max(runs) * bw
    where = "" if g.key == MEASURED_GPU else (f", scaled by HBM bandwidth (x {bw:.3g}), top x{OTHER_GPU_FACTOR:g}")
    return StepTerm("attention waits on one sequence's KV read (few sequences)", "per_mean_context_token_s", value,
                    "measured", f"decode step of {m.probe_name}'s backbone over batch 1..256 x context 512..8,192 "
                    f"on an H200 (docs/measured/decode_step-h200-run*.json): {runs[0] * 1e9:.4g} and "
                    f"{runs[1] * 1e9:.4g} ns a token of the mean sequence's context{where}; range 0..the higher run: "
                    f"vLLM's decode kernels may split one sequence over the GPU", low=0.0,
                    high=high * (1 if g.key == MEASURED_GPU else OTHER_GPU_FACTOR))


def step_terms(m: Model, g: GPU) -> tuple[tuple[StepTerm, ...], tuple[StepTerm, ...]]:
    """The backbone's step terms and the plugin's, for model ``m`` on GPU ``g``."""
    kv_tok = m.shape.kv_bytes_per_token
    graph_src, eager_src = ANCHORS["graph"][1], ANCHORS["eager"][1]
    _, streamed, experts, _ = weights(m, g)
    dense = streamed - experts
    w_hi = (f"range x1..x{WEIGHTS_MEASURED_OVER_DATASHEET}: datasheet peak, up to the plain-PyTorch time measured on "
            f"an H200")
    terms = [
        StepTerm("weights streamed once per step", "base_s", dense / g.hbm_bytes_per_s, "datasheet",
                 f"{dense / 1e9:g} GB / {g.hbm_bytes_per_s / 1e12:g} TB/s"
                 + (" (the dense part: attention, router, embeddings, LM head; the routed experts are priced by the "
                    "share a step reads)" if experts else "") + f"; {w_hi}",
                 low=dense / g.hbm_bytes_per_s, high=dense / g.hbm_bytes_per_s * WEIGHTS_MEASURED_OVER_DATASHEET),
    ]
    if experts:
        moe = experts / g.hbm_bytes_per_s
        terms.append(StepTerm(
            "routed experts, all of them (a step pays the share it reads)", "moe_experts_s", moe, "datasheet",
            f"{experts / 1e9:.4g} GB ({m.backbone_config['num_hidden_layers']} layers x "
            f"{m.backbone_config['num_experts']} experts x 3 x {m.backbone_config['hidden_size']} x "
            f"{m.backbone_config['moe_intermediate_size']} x 2 B) / {g.hbm_bytes_per_s / 1e12:g} TB/s; a step of n "
            f"tokens reads 1 - (1 - {m.moe_route:g})^n of them; range x1..x{MOE_MEASURED_OVER_DATASHEET}: the "
            f"coefficient fitted to the MoE step measured on an H200 (docs/measured/decode_step-h200-run*.json)",
            low=moe, high=moe * MOE_MEASURED_OVER_DATASHEET))
    vstep = vllm_step_s()
    terms += [
        StepTerm("vLLM per step (scheduling, sampling, graph launch)", "base_s", vstep, "anchored",
                 f"{graph_src}, less {LLAMA_8B_BYTES / 1e9:g} GB / {H100_HBM_BYTES_PER_S / 1e12:g} TB/s of weights; "
                 f"range 0..x2: weights at the 1.2x datasheet time measured on an H200 would take the whole anchored "
                 f"step, and the anchor is one figure", low=0.0, high=2 * vstep),
        StepTerm("vLLM per sequence (scheduler, sampler, detokeniser)", "per_seq_s", PER_SEQ_OVERHEAD_S, "estimated",
                 "assumed"),
        StepTerm("attention reads the resident KV", "per_context_token_s", kv_tok / g.hbm_bytes_per_s, "datasheet",
                 f"{kv_tok:,} B / {g.hbm_bytes_per_s / 1e12:g} TB/s; range x1..x{KV_MEASURED_OVER_DATASHEET}: "
                 f"measured 1.02-1.10x datasheet on an H200", low=kv_tok / g.hbm_bytes_per_s,
                 high=kv_tok / g.hbm_bytes_per_s * KV_MEASURED_OVER_DATASHEET),
        _mean_context_term(m, g),
    ]
    mm = 2 * m.shape.active_params / (g.bf16_flops * MFU)
    terms.append(StepTerm("matmul work per computed token", "per_new_token_s", mm, "estimated",
                          f"2 x {m.shape.active_params / 1e9:g}e9 active params / ({g.bf16_flops / 1e12:g} TFLOP/s x "
                          f"{MFU} MFU, assumed); range x{MATMUL_MEASURED_OVER_CHARGED:.2f}..x2: measured on an H200 it "
                          f"overlaps the weight streaming (Moshi's batch-256 step: 9.4 us a token outside attention)",
                          low=mm * MATMUL_MEASURED_OVER_CHARGED, high=2 * mm))
    table_bytes = m.shape.max_model_len_tokens // BLOCK_SIZE_TOKENS * BLOCK_TABLE_ENTRY_BYTES
    eager = m.shape.layers * eager_per_layer_s()
    lo_l, hi_l = EAGER_PER_LAYER_MEASURED_S["moe" if experts else "dense"]
    sync = ANCHORS["host_sync"][0]
    plugin = (
        StepTerm("eager mode, no CUDA graphs", "base_s", eager, "anchored",
                 f"{m.shape.layers} layers x {eager_per_layer_s() * 1e6:.0f} us ({eager_src}, less the CUDA-graph "
                 f"step, over {LLAMA_8B_LAYERS} layers; an MoE layer launches more kernels, so a lower bound there); "
                 f"range: {lo_l * 1e6:.0f}-{hi_l * 1e6:.0f} us a layer, measured on an H200",
                 low=min(eager, m.shape.layers * lo_l), high=max(eager, m.shape.layers * hi_l)),
        StepTerm("block table copied to the host (the sync)", "base_s", sync, "anchored",
                 f"{ANCHORS['host_sync'][1]}; range 1-3 ms: the source says about 2", low=sync / 2, high=1.5 * sync),
        StepTerm("block table copied to the host (the bytes)", "per_seq_s", table_bytes / g.pcie_bytes_per_s,
                 "datasheet", f"{table_bytes:,} B per request ({m.shape.max_model_len_tokens:,} tokens / "
                              f"{BLOCK_SIZE_TOKENS} x {BLOCK_TABLE_ENTRY_BYTES} B) / {g.pcie_bytes_per_s / 1e9:g} "
                              f"GB/s; range x1..x2: a small copy gets at least half the link",
                 low=table_bytes / g.pcie_bytes_per_s, high=2 * table_bytes / g.pcie_bytes_per_s),
        StepTerm("compaction (Python, per request)", "per_seq_s", COMPACTION_PER_REQUEST_S, "measured",
                 "benchmarks/bench_compaction.py: 256 requests a step on the development machine's CPU; range "
                 f"x/{OTHER_GPU_FACTOR:g}..x{OTHER_GPU_FACTOR:g}: a serving host's CPU is not that machine's",
                 low=COMPACTION_PER_REQUEST_S / OTHER_GPU_FACTOR, high=COMPACTION_PER_REQUEST_S * OTHER_GPU_FACTOR),
    )
    return tuple(terms), plugin


def estimate(model_key: str, gpu_key: str, date: str = "2026-12-01") -> Calibration:
    m, g = MODELS[model_key], GPUS[gpu_key]
    kv_tok = m.shape.kv_bytes_per_token
    bytes_per_block = kv_tok * BLOCK_SIZE_TOKENS
    resident, _, _, deployment = weights(m, g)
    pool_bytes = g.memory_bytes * GPU_MEMORY_UTILISATION - resident - ACTIVATION_RESERVE_BYTES
    num_blocks = int(pool_bytes // bytes_per_block)
    if num_blocks <= 0:
        raise ValueError(f"{model_key} on {gpu_key}: {resident / 1e9:g} GB of weights leave no KV pool")
    backbone, plugin = step_terms(m, g)
    stacks = stack_pricings(m, g)
    terms = backbone + stacks[0].terms
    step = StepLatencyModel(
        **sum_terms(terms),
        fitted_range={"batch": (1, 1024), "context_tokens": (0, num_blocks * BLOCK_SIZE_TOKENS),
                      "new_tokens": (1, MAX_NUM_BATCHED_TOKENS)},
        terms=terms, plugin_terms=plugin, moe_route=m.moe_route,
    )
    notes = (
        f"model: {m.source}",
        f"stream: {m.stream_note}",
        f"gpu: {g.source}",
        f"weights: {deployment}",
        f"KV bytes/token = 2 x {m.shape.layers} layers x {m.shape.kv_heads} KV heads x {m.shape.head_dim} head_dim "
        f"x {m.shape.dtype_bytes} B = {kv_tok:,} B",
        f"bytes/block = {kv_tok:,} B x {BLOCK_SIZE_TOKENS} tokens = {bytes_per_block:,} B",
        f"pool = {g.memory_bytes/1e9:g} GB x {GPU_MEMORY_UTILISATION} utilisation - {resident/1e9:g} GB weights "
        f"- {ACTIVATION_RESERVE_BYTES/1e9:g} GB activations = {pool_bytes/1e9:.2f} GB -> {num_blocks:,} blocks "
        f"({num_blocks * BLOCK_SIZE_TOKENS:,} tokens)",
        "step latency: each coefficient is the sum of the terms listed in step_latency.terms (name, value, basis, "
        "source, and a range where the basis is not 'estimated'): the backbone's, then the stack's in use; "
        "step_latency.plugin_terms are added when the sink+window plugin serves the policy",
        f"stacks: {', '.join(s.name for s in stacks)} (the first is the default; --stack NAME chooses another: "
        "each prices the frame pipeline's other stages as that stack runs them)",
        "estimated: datasheet numbers, published measurements of other deployments and this project's H200 "
        "measurements (docs/measured/); run metronome-probe on the target machine for a measured file",
    )
    return Calibration(
        name=f"{model_key}-{gpu_key}",
        description=f"{m.shape.name} on one {g.name}"
                    + (", FP8 thinker weights" if (m.key, g.key) in FP8_THINKER else "")
                    + ", estimated from datasheets and measurements",
        model=m.shape,
        stream=m.stream,
        engine=EnginePool(block_size_tokens=BLOCK_SIZE_TOKENS, num_blocks=num_blocks, bytes_per_block=bytes_per_block,
                          max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, watermark_blocks=0),
        step_latency=step,
        provenance=Provenance(kind="estimated", source="metronome.roofline (datasheets, published measurements, "
                                                       "docs/measured)",
                              hardware=g.name, date=date, engine="vLLM v1 (modelled)", weights="n/a", notes=notes),
        stack=stacks[0].name,
        stack_options=stacks,
    )


def write_presets(folder: Path) -> list[Path]:
    out = []
    for mk in MODELS:
        for gk in GPUS:
            cal = estimate(mk, gk)
            p = folder / f"{cal.name}.json"
            p.write_text(cal.to_json())
            out.append(p)
    return out


if __name__ == "__main__":  # python -m metronome.roofline [FOLDER]
    import sys

    folder = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "calibration")
    for p in write_presets(folder):
        print(p)
