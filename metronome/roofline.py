"""Estimated calibrations: pool size and step latency from datasheet numbers (a roofline).

Used to build the ``estimated`` presets in ``calibration/`` (``python -m metronome.roofline`` rewrites
them). Every number that goes in is written into the preset's provenance notes, so the arithmetic can be
checked by hand. The live probe replaces these with ``measured`` calibrations.

* KV bytes per token = 2·layers·kv_heads·head_dim·dtype_bytes.
* Pool blocks = floor((memory·utilisation − weights − activation reserve) / bytes per block).
* Step latency (decode is memory-bound, prefill compute-bound)::

    base_s              = fixed overhead + weight bytes / HBM bandwidth      (weights stream once per step)
    per_context_token_s = KV bytes per token / HBM bandwidth                  (attention reads the resident KV)
    per_new_token_s     = 2·active params / (bf16 peak · MFU)                 (matmul work per computed token)
    per_seq_s           = per-sequence scheduling, sampling and detokenisation overhead
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from metronome.calibration import (Calibration, EnginePool, ModelShape, Provenance, StepLatencyModel, TokenStream)


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    memory_bytes: float  # usable device memory
    hbm_bytes_per_s: float
    bf16_flops: float  # dense peak
    source: str


@dataclass(frozen=True)
class ModelSpec:
    key: str
    shape: ModelShape
    stream: TokenStream
    weight_bytes: float  # all weights resident on the device (encoders and talker included)
    streamed_weight_bytes: float  # weights read per decode step (MoE at large batch touches ~all experts)
    source: str
    stream_note: str


GPUS = {
    "h200": GPU("h200", "NVIDIA H200 SXM (141 GB HBM3e)", 141e9, 4.8e12, 989e12,
                "vendor datasheet: 141 GB, 4.8 TB/s, 989 TFLOP/s dense bf16"),
    "b200": GPU("b200", "NVIDIA B200 (≈180 GB usable HBM3e)", 180e9, 8.0e12, 2250e12,
                "vendor datasheet: 192 GB physical (≈180 GB exposed per GPU on HGX B200), 8 TB/s, 2.25 PFLOP/s dense bf16"),
}

MODELS = {
    "moshi-7b": ModelSpec(
        "moshi-7b",
        ModelShape("Moshi 7B (temporal transformer)", layers=32, kv_heads=32, head_dim=128, kv_dtype="bf16",
                   max_model_len_tokens=65536, params=7.7e9, active_params=7.7e9),
        TokenStream(frame_period_s=0.08, input_tokens_per_frame=0, output_tokens_per_frame=1),
        weight_bytes=15.4e9, streamed_weight_bytes=15.4e9,
        source="kyutai-labs/moshi configs/moshi_7b_202409.json: dim 4096, 32 heads, 32 layers, kv_repeat 1 (MHA), bf16",
        stream_note="12.5 Hz: one fused text+audio KV position per 80 ms frame (input folded into the decode step)",
    ),
    "qwen2.5-omni-7b": ModelSpec(
        "qwen2.5-omni-7b",
        ModelShape("Qwen2.5-Omni-7B (thinker)", layers=28, kv_heads=4, head_dim=128, kv_dtype="bf16",
                   max_model_len_tokens=32768, params=10.7e9, active_params=7.6e9),
        TokenStream(frame_period_s=2.0, input_tokens_per_frame=50, output_tokens_per_frame=4),
        weight_bytes=21.4e9, streamed_weight_bytes=15.2e9,
        source="transformers qwen2_5_omni configuration: thinker hidden 3584, 28 layers, 28 heads, 4 KV heads, head_dim 128",
        stream_note="25 audio tokens/s in TMRoPE 2 s chunks: 50 input tokens per 2 s frame, 4 text tokens out",
    ),
    "qwen3-omni-30b-a3b": ModelSpec(
        "qwen3-omni-30b-a3b",
        ModelShape("Qwen3-Omni-30B-A3B (thinker)", layers=48, kv_heads=4, head_dim=128, kv_dtype="bf16",
                   max_model_len_tokens=65536, params=35e9, active_params=3.3e9),
        TokenStream(frame_period_s=1.0, input_tokens_per_frame=13, output_tokens_per_frame=2),
        weight_bytes=70e9, streamed_weight_bytes=61e9,
        source="Qwen3-Omni thinker = Qwen3-30B-A3B attention: 48 layers, 32 heads, 4 KV heads, head_dim 128, 128 experts / 8 active",
        stream_note="13 audio tokens/s (12.5 Hz encoder) per 1 s frame, 2 text tokens out",
    ),
    "minicpm-o-4.5": ModelSpec(
        "minicpm-o-4.5",
        ModelShape("MiniCPM-o 4.5 (Qwen3-8B LLM)", layers=36, kv_heads=8, head_dim=128, kv_dtype="bf16",
                   max_model_len_tokens=40960, params=9e9, active_params=8.2e9),
        TokenStream(frame_period_s=1.0, input_tokens_per_frame=12, output_tokens_per_frame=8),
        weight_bytes=18e9, streamed_weight_bytes=16.4e9,
        source="MiniCPM-o 4.5 = Qwen3-8B LLM: 36 layers, 32 heads, 8 KV heads, head_dim 128",
        stream_note="1 Hz duplex unit: <unit> + 10 audio tokens + markers in, ~8 speak tokens out on average",
    ),
}

# Assumptions shared by every estimate (each is written into the preset's notes).
GPU_MEMORY_UTILISATION = 0.9
ACTIVATION_RESERVE_BYTES = 4e9
BLOCK_SIZE_TOKENS = 16
MAX_NUM_BATCHED_TOKENS = 8192
STEP_OVERHEAD_S = 2e-3
PER_SEQ_OVERHEAD_S = 2e-5
MFU = 0.5


def estimate(model_key: str, gpu_key: str, date: str = "2026-11-29") -> Calibration:
    m, g = MODELS[model_key], GPUS[gpu_key]
    kv_tok = m.shape.kv_bytes_per_token
    bytes_per_block = kv_tok * BLOCK_SIZE_TOKENS
    pool_bytes = g.memory_bytes * GPU_MEMORY_UTILISATION - m.weight_bytes - ACTIVATION_RESERVE_BYTES
    num_blocks = int(pool_bytes // bytes_per_block)
    weights_s = m.streamed_weight_bytes / g.hbm_bytes_per_s
    per_ctx = kv_tok / g.hbm_bytes_per_s
    per_new = 2 * m.shape.active_params / (g.bf16_flops * MFU)
    step = StepLatencyModel(
        base_s=STEP_OVERHEAD_S + weights_s,
        per_seq_s=PER_SEQ_OVERHEAD_S,
        per_context_token_s=per_ctx,
        per_new_token_s=per_new,
        fitted_range={"batch": (1, 1024), "context_tokens": (0, num_blocks * BLOCK_SIZE_TOKENS),
                      "new_tokens": (1, MAX_NUM_BATCHED_TOKENS)},
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
        f"base_s = {STEP_OVERHEAD_S*1e3:g} ms overhead + {m.streamed_weight_bytes/1e9:g} GB weights / "
        f"{g.hbm_bytes_per_s/1e12:g} TB/s = {step.base_s*1e3:.3f} ms",
        f"per_context_token_s = {kv_tok:,} B / {g.hbm_bytes_per_s/1e12:g} TB/s = {per_ctx:.3e} s",
        f"per_new_token_s = 2 x {m.shape.active_params/1e9:g}e9 active params / ({g.bf16_flops/1e12:g} TFLOP/s x "
        f"{MFU} MFU) = {per_new:.3e} s",
        f"per_seq_s = {PER_SEQ_OVERHEAD_S*1e6:g} us scheduling/sampling overhead per sequence (assumed)",
        "estimated: a roofline from datasheet numbers; run metronome-probe on the target machine for a measured file",
    )
    return Calibration(
        name=f"{model_key}-{gpu_key}",
        description=f"{m.shape.name} on one {g.name}, estimated from a roofline",
        model=m.shape,
        stream=m.stream,
        engine=EnginePool(block_size_tokens=BLOCK_SIZE_TOKENS, num_blocks=num_blocks, bytes_per_block=bytes_per_block,
                          max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, watermark_blocks=0),
        step_latency=step,
        provenance=Provenance(kind="estimated", source="metronome.roofline (datasheet roofline)", hardware=g.name,
                              date=date, engine="vLLM v1 (modelled)", weights="n/a", notes=notes),
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
