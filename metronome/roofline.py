"""Estimated calibrations: pool size and step latency from datasheet numbers and published measurements.

Used to build the ``estimated`` presets in ``calibration/``, one per model of :data:`metronome.models.MODELS`
and GPU of :data:`GPUS` (``python -m metronome.roofline`` rewrites them; a test checks the shipped files match). Every coefficient of the step-latency model is a sum of named terms
(:class:`~metronome.calibration.StepTerm`), each with its value, its basis and its source, written into the
preset; the report prints them. The live probe replaces all of it with a ``measured`` calibration.

* KV bytes per token = 2·layers·kv_heads·head_dim·dtype_bytes; pool blocks =
  floor((memory·utilisation − weights − activation reserve) / bytes per block).
* The backbone vLLM serves (decode is memory-bound, prefill compute-bound): its weights stream once per
  step, attention reads the resident KV, each computed token costs 2·active params of matmul work, and vLLM
  itself costs a little per step and per sequence (:data:`ANCHORS`: a batch-1 decode with CUDA graphs).
* The rest of the frame pipeline each model runs per session on the same GPU (:class:`Stage`: audio encoder,
  talker, code predictor or depformer, codec decoder or vocoder). Their per-session GPU time per second of
  conversation is charged to the backbone's steps as a per-sequence cost (a session takes ``output tokens per
  frame`` backbone steps a frame). The speech-generation stages are priced per sequential forward pass,
  anchored on vLLM-Omni's own Qwen3-Omni measurements; encoders by their matmul work.
* The sink+window plugin's own costs (:attr:`~metronome.kv_policy.KVPolicy.runs_plugin`) are
  ``plugin_terms``: eager mode (no CUDA graphs), the per-step block-table copy to the host and the sync it
  forces, and the compaction's own Python per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from metronome.calibration import Calibration, EnginePool, Provenance, StepLatencyModel, StepTerm, sum_terms
from metronome.models import MODELS, QWEN3_OMNI_SPEECH_PASSES_PER_S, Model, Stage


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
    # vLLM-Omni's CI perf baselines for Qwen3-Omni-30B-A3B on one H100 (vllm-project/vllm-omni PR #3695,
    # random 2500 tokens in / 900 out, audio out): mean audio real-time factor 0.400 at 16 concurrent requests,
    # 0.578 at 32. One more stream costs (0.578 − 0.400) / 16 s of GPU per second of speech.
    "speech": ((0.578 - 0.400) / 16, "Qwen3-Omni on one H100 under vLLM-Omni: audio RTF 0.400 at 16 concurrent "
                                     "requests, 0.578 at 32 (vllm-project/vllm-omni PR #3695 perf baselines)"),
}
LLAMA_8B_LAYERS = 32

# Assumptions shared by every estimate (each is written into the preset's notes).
GPU_MEMORY_UTILISATION = 0.9
ACTIVATION_RESERVE_BYTES = 4e9
BLOCK_SIZE_TOKENS = 16
MAX_NUM_BATCHED_TOKENS = 8192
PER_SEQ_OVERHEAD_S = 2e-5
MFU = 0.5
COMPACTION_PER_REQUEST_S = 12.6e-6  # benchmarks/bench_compaction.py on the development machine (README)
BLOCK_TABLE_ENTRY_BYTES = 4  # int32


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


def stage_s_per_s(stage: Stage, gpu: GPU) -> float:
    """GPU seconds per second of conversation one session costs in ``stage``."""
    if stage.kind == "decode":
        return stage.duty * stage.rate * pass_s(gpu)
    return stage.duty * stage.rate * 2 * stage.params / (gpu.bf16_flops * MFU)


def step_terms(m: Model, g: GPU) -> tuple[tuple[StepTerm, ...], tuple[StepTerm, ...]]:
    """The backbone's step terms and the plugin's, for model ``m`` on GPU ``g``."""
    kv_tok = m.shape.kv_bytes_per_token
    steps_per_frame = m.stream.output_tokens_per_frame
    graph_src, eager_src = ANCHORS["graph"][1], ANCHORS["eager"][1]
    terms = [
        StepTerm("weights streamed once per step", "base_s", m.streamed_weight_bytes / g.hbm_bytes_per_s, "datasheet",
                 f"{m.streamed_weight_bytes / 1e9:g} GB / {g.hbm_bytes_per_s / 1e12:g} TB/s"),
        StepTerm("vLLM per step (scheduling, sampling, graph launch)", "base_s", vllm_step_s(), "anchored",
                 f"{graph_src}, less {LLAMA_8B_BYTES / 1e9:g} GB / {H100_HBM_BYTES_PER_S / 1e12:g} TB/s of weights"),
        StepTerm("vLLM per sequence (scheduler, sampler, detokeniser)", "per_seq_s", PER_SEQ_OVERHEAD_S, "estimated",
                 "assumed"),
    ]
    for st in m.pipeline:
        per_step = stage_s_per_s(st, g) * m.stream.frame_period_s / steps_per_frame
        if st.kind == "decode":
            basis = "anchored" if st.rate == QWEN3_OMNI_SPEECH_PASSES_PER_S else "estimated"
            how = (f"{st.duty:g} duty x {st.rate:g} passes/s x {pass_s(g) * 1e6:.1f} us per pass per session "
                   f"(anchor: {ANCHORS['speech'][1]}; spread over {QWEN3_OMNI_SPEECH_PASSES_PER_S:g} passes/s, "
                   f"scaled by HBM bandwidth from the H100)")
        else:
            basis = "estimated"
            how = (f"{st.duty:g} duty x {st.rate:g} positions/s x 2 x {st.params / 1e9:g}e9 params / "
                   f"({g.bf16_flops / 1e12:g} TFLOP/s x {MFU} MFU)")
        terms.append(StepTerm(f"{st.name} (frame pipeline)", "per_seq_s", per_step, basis,
                              f"{st.source}; {how}; x {m.stream.frame_period_s:g} s frame / {steps_per_frame} "
                              f"backbone steps per frame"))
    terms += [
        StepTerm("attention reads the resident KV", "per_context_token_s", kv_tok / g.hbm_bytes_per_s, "datasheet",
                 f"{kv_tok:,} B / {g.hbm_bytes_per_s / 1e12:g} TB/s"),
        StepTerm("matmul work per computed token", "per_new_token_s", 2 * m.shape.active_params / (g.bf16_flops * MFU),
                 "estimated", f"2 x {m.shape.active_params / 1e9:g}e9 active params / ({g.bf16_flops / 1e12:g} "
                              f"TFLOP/s x {MFU} MFU, assumed)"),
    ]
    table_bytes = m.shape.max_model_len_tokens // BLOCK_SIZE_TOKENS * BLOCK_TABLE_ENTRY_BYTES
    plugin = (
        StepTerm("eager mode, no CUDA graphs", "base_s", m.shape.layers * eager_per_layer_s(), "anchored",
                 f"{m.shape.layers} layers x {eager_per_layer_s() * 1e6:.0f} us ({eager_src}, less the CUDA-graph "
                 f"step, over {LLAMA_8B_LAYERS} layers; an MoE layer launches more kernels, so a lower bound there)"),
        StepTerm("block table copied to the host (the sync)", "base_s", ANCHORS["host_sync"][0], "anchored",
                 ANCHORS["host_sync"][1]),
        StepTerm("block table copied to the host (the bytes)", "per_seq_s", table_bytes / g.pcie_bytes_per_s,
                 "datasheet", f"{table_bytes:,} B per request ({m.shape.max_model_len_tokens:,} tokens / "
                              f"{BLOCK_SIZE_TOKENS} x {BLOCK_TABLE_ENTRY_BYTES} B) / {g.pcie_bytes_per_s / 1e9:g} GB/s"),
        StepTerm("compaction (Python, per request)", "per_seq_s", COMPACTION_PER_REQUEST_S, "measured",
                 "benchmarks/bench_compaction.py: 256 requests a step on the development machine's CPU"),
    )
    return tuple(terms), plugin


def estimate(model_key: str, gpu_key: str, date: str = "2026-12-01") -> Calibration:
    m, g = MODELS[model_key], GPUS[gpu_key]
    kv_tok = m.shape.kv_bytes_per_token
    bytes_per_block = kv_tok * BLOCK_SIZE_TOKENS
    pool_bytes = g.memory_bytes * GPU_MEMORY_UTILISATION - m.weight_bytes - ACTIVATION_RESERVE_BYTES
    num_blocks = int(pool_bytes // bytes_per_block)
    terms, plugin = step_terms(m, g)
    step = StepLatencyModel(
        **sum_terms(terms),
        fitted_range={"batch": (1, 1024), "context_tokens": (0, num_blocks * BLOCK_SIZE_TOKENS),
                      "new_tokens": (1, MAX_NUM_BATCHED_TOKENS)},
        terms=terms, plugin_terms=plugin,
    )
    notes = (
        f"model: {m.source}",
        f"stream: {m.stream_note}",
        f"gpu: {g.source}",
        f"KV bytes/token = 2 x {m.shape.layers} layers x {m.shape.kv_heads} KV heads x {m.shape.head_dim} head_dim "
        f"x {m.shape.dtype_bytes} B = {kv_tok:,} B",
        f"bytes/block = {kv_tok:,} B x {BLOCK_SIZE_TOKENS} tokens = {bytes_per_block:,} B",
        f"pool = {g.memory_bytes/1e9:g} GB x {GPU_MEMORY_UTILISATION} utilisation - {m.weight_bytes/1e9:g} GB weights "
        f"- {ACTIVATION_RESERVE_BYTES/1e9:g} GB activations = {pool_bytes/1e9:.2f} GB -> {num_blocks:,} blocks "
        f"({num_blocks * BLOCK_SIZE_TOKENS:,} tokens)",
        "step latency: each coefficient is the sum of the terms listed in step_latency.terms (name, value, basis, "
        "source); step_latency.plugin_terms are added when the sink+window plugin serves the policy",
        "estimated: datasheet numbers and published measurements of other deployments; run metronome-probe on the "
        "target machine for a measured file",
    )
    return Calibration(
        name=f"{model_key}-{gpu_key}",
        description=f"{m.shape.name} on one {g.name}, estimated from datasheets and published measurements",
        model=m.shape,
        stream=m.stream,
        engine=EnginePool(block_size_tokens=BLOCK_SIZE_TOKENS, num_blocks=num_blocks, bytes_per_block=bytes_per_block,
                          max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, watermark_blocks=0),
        step_latency=step,
        provenance=Provenance(kind="estimated", source="metronome.roofline (datasheets and published measurements)",
                              hardware=g.name, date=date, engine="vLLM v1 (modelled)", weights="n/a", notes=notes),
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
