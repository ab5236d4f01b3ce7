"""Each stage of each model's frame pipeline, timed in its shape: ``python -m metronome.probe.stage_timers``.

The backbone is vLLM's and ``metronome.probe.decode_step`` times it; everything else a model runs every frame on
the same GPU (Moshi's depformer and Mimi codec, the Qwen talkers, code predictor, Code2Wav and token2wav,
MiniCPM-o's TTS LM and vocoder, the audio encoders) is the serving stack's own, and how the stack runs it moves
the price by 10×. So each stage is timed, with random weights (bf16 on a GPU, float32 on a CPU), in both of the
ways a stack can run it:

* **batched**: one launch for the B sessions in the step (a fixed cost per launch plus a cost per session), or
  **per session**: each session's stage alone, one after another (B launches);
* **CUDA graphs** or **eager** (on a CPU eager only: graphs need a CUDA device).

Each stage's timed *unit* (a frame, a token, a chunk) is named with the units it runs a second and how many of
``metronome.models``' passes it is, and each mode's points are fitted to ``unit_s = per_launch_s +
per_session_s·B``, so ``metronome.roofline`` can price a stack's choice of modes with provenance ``measured``
(the file's schema: docs/measured/README.md). The shapes are the models' own where their configs are public and
approximations where not; each timer's ``shape_note`` says which. The Qwen3-Omni thinker's routed MoE is timed
too (``backbone``): its step reads the experts its batch touches, E·(1 − (1 − k/E)^B), not a line in B.

``--plan`` prints what the full run costs on an H200 without running it (a cost model from kernel counts,
FLOPs and bytes, calibrated on the H200 depformer run in docs/measured/), and the run prints its running budget.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import dataclass

import numpy as np

from metronome.calibration import StepTerm
from metronome.errors import MetronomeError, run_command
from metronome.models import BATCHED, MODELS, PER_SESSION, STACKS, Mode, Stack

FIT_TERMS = {"per_launch_s": lambda p: 1.0, "per_session_s": lambda p: p["batch"]}


@dataclass(frozen=True)
class Timer:
    """One timed part of a model's frame pipeline.

    ``prices``: the pipeline stage names (``metronome.models`` ``Stage.name``, or one ``+``-joined part of one,
    lower case) it is the cost of. ``unit``: what one timed call does per session; ``units_per_s``: such units a
    second while the stage runs (a second of speech for the speech side); ``passes_per_unit``: how many of the
    ``Stage.rate`` counts (passes or positions) one unit is, so a stage's rate is the sum over its timers of
    ``units_per_s · passes_per_unit``."""

    model: str
    name: str
    prices: tuple[str, ...]
    kind: str
    unit: str
    units_per_s: float
    passes_per_unit: float
    full: dict
    small: dict
    shape_note: str


# --- the shapes ------------------------------------------------------------------------------------------------

_LM_SMALL = {"layers": 2, "dim": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 128, "vocab": 100,
             "context": 32, "in_dim": 64}
_ENC_SMALL = {"mel": 16, "frames": 20, "stride": 2, "dim": 32, "layers": 2, "heads": 2, "ffn": 64, "out_dim": 32}
_MIMI = {"filters": 64, "ratios": (4, 5, 6, 8), "kernel": 7, "res_kernel": 3, "last_kernel": 3, "dim": 512,
         "layers": 8, "heads": 8, "ffn": 2048, "context": 250, "down": 2, "frame": 1920, "codebooks": 8,
         "card": 2048, "cb_dim": 256}
_MIMI_SMALL = {"filters": 4, "ratios": (2, 2, 2, 2), "kernel": 7, "res_kernel": 3, "last_kernel": 3, "dim": 32,
               "layers": 2, "heads": 2, "ffn": 64, "context": 16, "down": 2, "frame": 64, "codebooks": 8,
               "card": 64, "cb_dim": 16}
_MIMI_NOTE = ("Mimi (kyutai-labs/moshi loaders: SEANet n_filters 64, ratios 8/6/5/4, kernel 7, residual kernel 3, "
              "dimension 512; transformer 8 layers, d 512, 8 heads, FFN 2048, context 250; 12.5 Hz, 24 kHz): one 80 ms "
              "frame streamed; causal convs over the new samples plus each layer's left context (kept per session, "
              "prepended); ConvTranspose tails that overlap the next frame dropped; RVQ as 8 sequential "
              "nearest-codeword searches over 2048 codes (the semantic/acoustic split not modelled)")

_BACKBONE_MOE = MODELS["qwen3-omni-30b-a3b"].backbone_config

TIMERS: dict[str, dict[str, Timer]] = {}


def _add(*timers: Timer) -> None:
    for t in timers:
        TIMERS.setdefault(t.model, {})[t.name] = t


_add(
    Timer("moshi-7b", "depformer", ("depformer",), "multi_pass", "one 80 ms frame: 8 sequential steps", 12.5, 8,
          {"steps": 8, "layers": 6, "dim": 1024, "heads": 16, "kv_heads": 16, "head_dim": 64, "ffn": 2816,
           "in_dim": 4096, "card": 2048, "per_step_weights": True},
          {"steps": 8, "layers": 2, "dim": 64, "heads": 4, "kv_heads": 4, "head_dim": 16, "ffn": 128, "in_dim": 128,
           "card": 100, "per_step_weights": True},
          "kyutai-labs/moshi loaders._lm_kwargs: 8 steps a frame (one per audio codebook), each 6 layers of dim 1024, "
          "16 heads, gated FFN 2816, weights of its own per step; in from the temporal transformer's 4096, 2048 "
          "logits out; its KV (the frame's steps so far) resets each frame"),
    Timer("moshi-7b", "mimi_encoder", ("mimi encoder",), "mimi_encoder", "one 80 ms frame: 1920 samples to 8 codes",
          12.5, 1, _MIMI, _MIMI_SMALL, _MIMI_NOTE),
    Timer("moshi-7b", "mimi_decoder", ("mimi decoder",), "mimi_decoder", "one 80 ms frame: 8 codes to 1920 samples",
          12.5, 1, _MIMI, _MIMI_SMALL, _MIMI_NOTE),
    Timer("qwen2.5-omni-7b", "audio_encoder", ("audio encoder",), "audio_encoder",
          "one 2 s chunk: 200 mel frames to 100 positions", 0.5, 100,
          {"mel": 128, "frames": 200, "stride": 2, "dim": 1280, "layers": 32, "heads": 20, "ffn": 5120,
           "out_dim": 3584}, _ENC_SMALL,
          "Whisper-large-v3-style (Qwen2.5-Omni audio config: 32 layers, d 1280, 20 heads, FFN 5120, 128 mel): two "
          "convs (the second stride 2) then full attention within the 2 s chunk (TMRoPE chunks), projected to the "
          "thinker's 3584; RMSNorm for LayerNorm"),
    Timer("qwen2.5-omni-7b", "talker", ("talker",), "lm_step", "one codec token", 50.0, 1,
          {"layers": 24, "dim": 896, "heads": 14, "kv_heads": 2, "head_dim": 64, "ffn": 4864, "vocab": 8448,
           "context": 1024, "in_dim": 3584}, _LM_SMALL,
          "Qwen2.5-Omni talker (24 layers, hidden 896, 14 heads, 2 KV heads, FFN 4864, codec vocab 8448): one decode "
          "step over 1024 positions of KV (assumed: the thinker's states plus the codec tokens so far), the "
          "thinker's 3584-wide state projected in"),
    Timer("qwen2.5-omni-7b", "token2wav", ("token2wav",), "dit_bigvgan",
          "one 1 s chunk: 50 codec tokens, 10 ODE steps of the DiT over 100 mel frames, BigVGAN to 24,000 samples",
          1.0, 11,
          {"tokens": 50, "frames": 100, "mel": 80, "code_dim": 512, "code_vocab": 8193, "dim": 1024, "layers": 22,
           "heads": 16, "ffn": 2048, "steps": 10, "cfg": True, "channels": 1536, "rates": (5, 3, 2, 2, 2, 2),
           "up_kernels": (11, 7, 4, 4, 4, 4), "res_kernels": (3, 7, 11), "dilations": (1, 3, 5)},
          {"tokens": 4, "frames": 8, "mel": 8, "code_dim": 16, "code_vocab": 64, "dim": 32, "layers": 1, "heads": 2,
           "ffn": 64, "steps": 10, "cfg": True, "channels": 16, "rates": (2, 2), "up_kernels": (4, 4),
           "res_kernels": (3,), "dilations": (1, 3)},
          "Qwen2.5-Omni token2wav: DiT (22 layers, dim 1024, 16 heads, FFN 2048, adaLN from the step's time embedding) "
          "over the chunk's 100 mel frames, 10 Euler ODE steps with classifier-free guidance (the batch doubled), "
          "full attention within the chunk (the block look-back/ahead mask not modelled); BigVGAN (1536 channels, "
          "upsampling 5/3/2/2/2/2, AMP blocks of kernels 3/7/11 × dilations 1/3/5, Snake) to 24 kHz, without its "
          "anti-aliasing filters"),
    Timer("qwen3-omni-30b-a3b", "audio_encoder", ("audio encoder",), "audio_encoder",
          "one 1 s chunk: 100 mel frames to 25 positions", 1.0, 25,
          {"mel": 128, "frames": 100, "stride": 4, "dim": 1280, "layers": 32, "heads": 20, "ffn": 5120,
           "out_dim": 2048}, _ENC_SMALL,
          "AuT (transformers Qwen3OmniMoeAudioEncoderConfig: 32 layers, d 1280, 20 heads, FFN 5120, 128 mel): the conv "
          "front end as two convs (the second stride 4) to 25 positions/s, full attention within the 1 s chunk "
          "(its windowed attention), projected to the thinker's 2048"),
    Timer("qwen3-omni-30b-a3b", "talker", ("talker",), "lm_step", "one codec frame's talker step", 12.5, 1,
          {"layers": 20, "dim": 1024, "heads": 16, "kv_heads": 2, "head_dim": 128, "experts": 128, "topk": 8,
           "moe_ffn": 384, "vocab": 3072, "context": 1024, "in_dim": 2048},
          {**_LM_SMALL, "experts": 8, "topk": 2, "moe_ffn": 32},
          "Qwen3-Omni talker (transformers Qwen3OmniMoeTalkerTextConfig: 20 layers, hidden 1024, 16 heads, 2 KV heads, "
          "128 experts of 384, 8 active: 3.0B in experts, ~0.3B active; head_dim 128 assumed; no shared expert): one "
          "decode step over 1024 positions of KV (assumed), the thinker's 2048-wide state projected in"),
    Timer("qwen3-omni-30b-a3b", "code_predictor", ("code predictor",), "multi_pass",
          "one codec frame: 15 sequential passes (codebooks 1-15)", 12.5, 15,
          {"steps": 15, "layers": 5, "dim": 1024, "heads": 16, "kv_heads": 8, "head_dim": 128, "ffn": 3072,
           "in_dim": 1024, "card": 2048, "per_step_weights": False},
          {"steps": 15, "layers": 2, "dim": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 128, "in_dim": 64,
           "card": 100, "per_step_weights": False},
          "Qwen3-Omni code predictor (transformers Qwen3OmniMoeTalkerCodePredictorConfig: 5 layers, hidden 1024, 16 "
          "heads, 8 KV heads, head_dim 128, FFN 3072, 2048 codes): 15 passes a frame through shared layers, each "
          "codebook's own embedding and head; its KV (the frame's passes so far) resets each frame"),
    Timer("qwen3-omni-30b-a3b", "code2wav", ("code2wav",), "code2wav",
          "one codec frame: 16 codes to 1920 samples", 12.5, 1,
          {"quantizers": 16, "card": 2048, "dim": 1024, "layers": 8, "heads": 16, "ffn": 3072, "window": 72,
           "up": (2, 2), "decoder_dim": 1536, "rates": (8, 5, 4, 3), "kernel": 7, "dilations": (1, 3, 9)},
          {"quantizers": 16, "card": 64, "dim": 32, "layers": 2, "heads": 2, "ffn": 64, "window": 8, "up": (2, 2),
           "decoder_dim": 32, "rates": (2, 2, 2, 2), "kernel": 7, "dilations": (1, 3, 9)},
          "Qwen3-Omni Code2Wav (transformers Qwen3OmniMoeCode2WavConfig: 16 quantizers of 2048, transformer 8 layers "
          "hidden 1024, FFN 3072, sliding window 72; ConvTranspose ×2 ×2 with ConvNeXt blocks; decoder 1536 channels "
          "upsampling 8/5/4/3 with residual units of dilation 1/3/9, Snake): one frame streamed, causal convs over "
          "the new samples plus each layer's left context"),
    Timer("minicpm-o-4.5", "audio_encoder", ("audio encoder",), "audio_encoder",
          "one 1 s chunk: 100 mel frames to 50 positions", 1.0, 50,
          {"mel": 80, "frames": 100, "stride": 2, "dim": 1024, "layers": 24, "heads": 16, "ffn": 4096,
           "out_dim": 4096}, _ENC_SMALL,
          "Whisper-medium (24 layers, d 1024, 16 heads, FFN 4096, 80 mel): two convs (the second stride 2), full "
          "attention within the 1 s chunk, projected to the LLM's 4096 (the resampler as one projection)"),
    Timer("minicpm-o-4.5", "tts_lm", ("tts lm",), "lm_step", "one speech token", 25.0, 1,
          {"layers": 24, "dim": 896, "heads": 14, "kv_heads": 2, "head_dim": 64, "ffn": 4864, "vocab": 6564,
           "context": 512, "in_dim": 4096}, _LM_SMALL,
          "CosyVoice2-style TTS LM as CosyVoice2's own (Qwen2.5-0.5B: 24 layers, hidden 896, 14 heads, 2 KV heads, "
          "FFN 4864; 6561 speech tokens + 3): one decode step over 512 positions of KV (assumed), the LLM's 4096-wide "
          "state projected in"),
    Timer("minicpm-o-4.5", "vocoder", ("flow-matching vocoder", "vocoder"), "cfm_hift",
          "one 1 s chunk: 25 speech tokens, 10 ODE steps over 50 mel frames, HiFT to 24,000 samples", 1.0, 10,
          {"tokens": 25, "frames": 50, "mel": 80, "vocab": 6561, "enc_dim": 512, "enc_layers": 6, "enc_heads": 8,
           "enc_ffn": 2048, "channels": 256, "blocks": 14, "tf_per_block": 4, "heads": 4, "ffn": 1024, "steps": 10,
           "cfg": True, "hift_channels": 512, "rates": (8, 5, 3), "up_kernels": (16, 11, 7),
           "res_kernels": (3, 7, 11), "dilations": (1, 3, 5), "n_fft": 16, "hop": 4},
          {"tokens": 4, "frames": 8, "mel": 8, "vocab": 64, "enc_dim": 16, "enc_layers": 1, "enc_heads": 2,
           "enc_ffn": 32, "channels": 16, "blocks": 2, "tf_per_block": 1, "heads": 2, "ffn": 32, "steps": 10,
           "cfg": True, "hift_channels": 16, "rates": (2, 2), "up_kernels": (4, 4), "res_kernels": (3,),
           "dilations": (1, 3), "n_fft": 16, "hop": 4},
          "CosyVoice2's flow + HiFT (assumed for MiniCPM-o 4.5): the token encoder (6 layers, d 512) upsampled ×2 to "
          "50 Hz mel; the flow-matching estimator (14 blocks of a causal conv ResNet block + 4 transformer layers, 256 "
          "channels) for 10 Euler steps with classifier-free guidance (the batch doubled); HiFT (512 channels, "
          "upsampling 8/5/3, resblocks 3/7/11 × 1/3/5) with its iSTFT (n_fft 16, hop 4) as a transposed conv of the "
          "same shape; its harmonic source module not modelled"),
)

# The thinker's routed MoE: not a pipeline stage (vLLM serves the backbone, always batched), timed for its curve.
BACKBONE = Timer(
    "qwen3-omni-30b-a3b", "moe", (), "moe_ffn", "one decode step's routed MoE, all layers, one token per session",
    0.0, 0,
    {"layers": _BACKBONE_MOE["num_hidden_layers"], "dim": _BACKBONE_MOE["hidden_size"],
     "experts": _BACKBONE_MOE["num_experts"], "topk": _BACKBONE_MOE["num_experts_per_tok"],
     "moe_ffn": _BACKBONE_MOE["moe_intermediate_size"]},
    {"layers": 2, "dim": 64, "experts": 16, "topk": 2, "moe_ffn": 32},
    "the thinker's routed experts (metronome.models backbone_config) without attention: router, top-k, one grouped "
    "GEMM per projection over the tokens sorted by expert (decode_step's MoE, what a fused MoE kernel reads); "
    "random router weights route near-uniformly, so the experts read follow E·(1 − (1 − k/E)^B); real routing is "
    "less even")


def expected_experts(batch: int, experts: int, topk: int) -> float:
    """Distinct experts a batch of ``batch`` tokens reads when each picks ``topk`` of ``experts`` uniformly."""
    return experts * (1.0 - (1.0 - topk / experts) ** batch)


def stage_components(stage_name: str) -> list[str]:
    """A pipeline stage's name as the parts it joins with ``+``, lower case ("Mimi encoder + decoder": "mimi
    encoder", "decoder")."""
    return [part.strip().lower() for part in stage_name.split("+") if part.strip()]


def timers_for(model: str, stage_name: str) -> list[str]:
    """The timers that price one of ``metronome.models`` pipeline stages. A part that names no timer is tried with
    the previous part's leading words ("Mimi encoder + decoder": "mimi decoder"). Raises KeyError for a part no
    timer prices."""
    timers = TIMERS.get(model, {})
    out, prev = [], []
    for part in stage_components(stage_name):
        candidates = [part] + ([" ".join(prev[:-1] + [part])] if len(prev) > 1 else [])
        hit = next((t.name for c in candidates for t in timers.values() if c in t.prices), None)
        if hit is None:
            raise KeyError(f"{model}: no stage timer prices {part!r} (of pipeline stage {stage_name!r})")
        out.append(hit)
        prev = part.split()
    return out


# --- building blocks (random weights; on the meta device, shapes only) -----------------------------------------

class _Params:
    """Random tensors scaled by fan-in (the values do not change a kernel's time, but a deep random stack that
    overflows to inf or underflows to denormals can on a CPU); on the meta device, shapes only.

    Weights (``weight`` and what builds on it) are made once per timer and handed out again, in the order a
    builder asks for them, at every batch it is built for (``begin`` restarts the order); inputs and state
    (``randn``, ``zeros``, ``tokens``) are made per build."""

    def __init__(self, device: str, dtype, seed: int = 0):
        import torch

        self.torch, self.device, self.dtype = torch, device, dtype
        self.gen = None if device == "meta" else torch.Generator(device=device).manual_seed(seed)
        self.weights: dict = {}
        self.i = 0

    def begin(self) -> "_Params":
        self.i = 0
        return self

    def randn(self, *shape, scale: float = 1.0):
        if self.device == "meta":
            return self.torch.empty(*shape, device="meta", dtype=self.dtype)
        return self.torch.randn(*shape, device=self.device, dtype=self.dtype, generator=self.gen).mul_(scale)

    def weight(self, *shape, scale: float = 1.0, offset: float = 0.0):
        key = (self.i, shape)
        self.i += 1
        if key not in self.weights:
            w = self.randn(*shape, scale=scale)
            self.weights[key] = w.add_(offset) if offset and self.device != "meta" else w
        return self.weights[key]

    def zeros(self, *shape):
        return self.torch.zeros(*shape, device=self.device, dtype=self.dtype)

    def tokens(self, *shape, high: int):
        if self.device == "meta":
            return self.torch.zeros(*shape, device="meta", dtype=self.torch.long)
        return self.torch.randint(0, high, shape, device=self.device, generator=self.gen)

    def lin(self, i: int, o: int):
        return self.weight(i, o, scale=i ** -0.5)

    def conv(self, o: int, i: int, k: int):
        return self.weight(o, i, k, scale=(i * k) ** -0.5)

    def convt(self, i: int, o: int, k: int):
        return self.weight(i, o, k, scale=(i * k) ** -0.5)

    def channel(self, c: int):
        """A per-channel parameter [1, C, 1] near 1 (Snake's α and 1/β)."""
        return self.weight(1, c, 1, scale=0.1, offset=1.0)


def _moe_params(mk: _Params, dim: int, experts: int, ffn: int, topk: int) -> dict:
    # Expert weights stored [E, out, in] as nn.Linear keeps them, seen as [E, in, out] (decode_step's layout).
    return {"router": mk.lin(dim, experts),
            "gate_up": mk.weight(experts, 2 * ffn, dim, scale=dim ** -0.5).transpose(-2, -1),
            "down": mk.weight(experts, dim, ffn, scale=ffn ** -0.5).transpose(-2, -1), "topk": topk}


def _tf(mk: _Params, layers: int, dim: int, heads: int, kv_heads: int, head_dim: int, ffn: int, *,
        gated: bool = True, moe: dict | None = None, adaln: bool = False) -> list[dict]:
    out = []
    for _ in range(layers):
        lp = {"qkv": mk.lin(dim, (heads + 2 * kv_heads) * head_dim), "o": mk.lin(heads * head_dim, dim),
              "H": heads, "KVH": kv_heads, "hd": head_dim}
        if moe:
            lp.update(_moe_params(mk, dim, moe["experts"], moe["ffn"], moe["topk"]), moe=moe["kind"])
        else:
            lp.update(up=mk.lin(dim, (2 if gated else 1) * ffn), down=mk.lin(ffn, dim), gated=gated)
        if adaln:
            lp["ada"] = mk.lin(dim, 6 * dim)
        out.append(lp)
    return out


def _attn(lp: dict, h, cache=None):
    """Self-attention of x [B, T, D] (already normed): with ``cache`` (k, v [B, KVH, C, hd], slot), the T new
    positions are written at ``slot`` and attend over positions [0, slot + T); without, over each other. The new
    positions are not masked among themselves (a frame's few positions; a small approximation)."""
    import torch.nn.functional as F

    B, T, _ = h.shape
    H, KVH, hd = lp["H"], lp["KVH"], lp["hd"]
    q, k, v = (h @ lp["qkv"]).split([H * hd, KVH * hd, KVH * hd], -1)
    q = q.view(B, T, H, hd).transpose(1, 2)
    k = k.view(B, T, KVH, hd).transpose(1, 2)
    v = v.view(B, T, KVH, hd).transpose(1, 2)
    if cache is not None:
        kc, vc, slot = cache
        kc[:, :, slot:slot + T] = k
        vc[:, :, slot:slot + T] = v
        k, v = kc[:, :, :slot + T], vc[:, :, :slot + T]
    # grouped: each KV head serves H/KVH query heads, all T positions of them at once
    att = F.scaled_dot_product_attention(q.reshape(B, KVH, (H // KVH) * T, hd), k, v)
    return att.reshape(B, H, T, hd).transpose(1, 2).reshape(B, T, H * hd) @ lp["o"]


def _ffn(lp: dict, h):
    import torch
    import torch.nn.functional as F

    from metronome.probe.decode_step import _moe_grouped, _moe_loop

    if "router" in lp:
        B, T, D = h.shape
        flat = h.reshape(B * T, D)
        wts, idx = torch.topk(torch.softmax((flat @ lp["router"]).float(), -1), lp["topk"], dim=-1)
        return (_moe_grouped if lp["moe"] == "grouped" else _moe_loop)(lp, flat, wts, idx).view(B, T, D)
    if lp["gated"]:
        a, b = (h @ lp["up"]).chunk(2, -1)
        return (F.silu(a) * b) @ lp["down"]
    return F.gelu(h @ lp["up"]) @ lp["down"]


def _block(lp: dict, x, cache=None, temb=None):
    """One pre-norm transformer layer on x [B, T, D]; ``temb`` [B, D]: adaLN (shift, scale, gate ×2) from it."""
    import torch.nn.functional as F

    D = x.shape[-1]
    if temb is None:
        x = x + _attn(lp, F.rms_norm(x, (D,)), cache)
        return x + _ffn(lp, F.rms_norm(x, (D,)))
    s1, c1, g1, s2, c2, g2 = (temb @ lp["ada"]).unsqueeze(1).chunk(6, -1)
    x = x + g1 * _attn(lp, F.rms_norm(x, (D,)) * (1 + c1) + s1)
    return x + g2 * _ffn(lp, F.rms_norm(x, (D,)) * (1 + c2) + s2)


def _moe_kind(mk: _Params, moe_params: dict, dim: int) -> str:
    """decode_step's choice (grouped GEMM where this torch has it and it agrees with the loop), grouped on meta."""
    from metronome.probe.decode_step import _choose_moe

    if mk.device == "meta":
        return "grouped"
    return _choose_moe(moe_params, mk.randn(64, dim))


class _Stream:
    """Streaming causal convolutions: each layer keeps its left context per session (prepended to the new
    samples); a transposed conv's tail, which overlaps the next chunk, is dropped."""

    def __init__(self, mk: _Params, batch: int):
        self.mk, self.B = mk, batch

    def conv(self, cin: int, cout: int, k: int, stride: int = 1, dil: int = 1, groups: int = 1):
        import torch
        import torch.nn.functional as F

        w = self.mk.conv(cout, cin // groups, k)
        state = self.mk.zeros(self.B, cin, dil * (k - 1) + 1 - stride)
        return lambda x: F.conv1d(torch.cat([state, x], -1), w, stride=stride, dilation=dil, groups=groups)

    def convt(self, cin: int, cout: int, k: int, stride: int, groups: int = 1):
        import torch.nn.functional as F

        w = self.mk.convt(cin, cout // groups, k)
        return lambda x: F.conv_transpose1d(x, w, stride=stride, groups=groups)[..., :x.shape[-1] * stride]


def _conv(mk: _Params, cin: int, cout: int, k: int, dil: int = 1):
    """A non-streaming 'same' conv (a chunk vocoder's)."""
    import torch.nn.functional as F

    w = mk.conv(cout, cin, k)
    pad = dil * (k - 1) // 2
    return lambda x: F.conv1d(x, w, padding=pad, dilation=dil)[..., :x.shape[-1]]


def _convt(mk: _Params, cin: int, cout: int, k: int, stride: int):
    import torch.nn.functional as F

    w = mk.convt(cin, cout, k)
    pad = (k - stride + 1) // 2
    return lambda x: F.conv_transpose1d(x, w, stride=stride, padding=pad)[..., :x.shape[-1] * stride]


def _snake(mk: _Params, c: int):
    alpha, inv_beta = mk.channel(c), mk.channel(c)
    return lambda x: x + (alpha * x).sin().pow(2) * inv_beta


# --- the stages ------------------------------------------------------------------------------------------------

def _build_multi_pass(c: dict, B: int, mk: _Params):
    """Sequential passes through a small transformer, one per codebook, each with its own embedding and head
    (and, with per_step_weights, its own layers): Moshi's depformer, Qwen3-Omni's code predictor."""
    S, L, D, H = c["steps"], c["layers"], c["dim"], c["heads"]
    KVH, hd = c["kv_heads"], c["head_dim"]
    stacks = [_tf(mk, L, D, H, KVH, hd, c["ffn"]) for _ in range(S if c["per_step_weights"] else 1)]
    ins = [mk.lin(c["in_dim"], D) for _ in range(len(stacks))]
    embs = [mk.weight(c["card"], D) for _ in range(S)]
    heads = [mk.lin(D, c["card"]) for _ in range(S)]
    h = mk.randn(B, c["in_dim"])
    caches = [(mk.zeros(B, KVH, S, hd), mk.zeros(B, KVH, S, hd)) for _ in range(L)]
    tok0 = mk.tokens(B, high=c["card"])

    def frame():
        tok = tok0
        for s in range(S):
            x = (h @ ins[s % len(stacks)] + embs[s][tok]).unsqueeze(1)
            for li, lp in enumerate(stacks[s % len(stacks)]):
                x = _block(lp, x, (caches[li][0], caches[li][1], s))
            tok = (x[:, 0] @ heads[s]).argmax(-1)
        return tok
    return frame


def _mimi_transformer(c: dict, B: int, mk: _Params):
    D, H = c["dim"], c["heads"]
    layers = _tf(mk, c["layers"], D, H, H, D // H, c["ffn"], gated=False)
    caches = [(mk.zeros(B, H, c["context"], D // H), mk.zeros(B, H, c["context"], D // H)) for _ in layers]

    def run(y):  # [B, T, D]: the frame's new positions, written at the end of the context
        slot = c["context"] - y.shape[1]
        for lp, (kc, vc) in zip(layers, caches):
            y = _block(lp, y, (kc, vc, slot))
        return y
    return run


def _build_mimi_encoder(c: dict, B: int, mk: _Params):
    import torch.nn.functional as F

    st = _Stream(mk, B)
    first = st.conv(1, c["filters"], c["kernel"])
    blocks, ch = [], c["filters"]
    for r in c["ratios"]:
        blocks.append((st.conv(ch, ch // 2, c["res_kernel"]), st.conv(ch // 2, ch, 1), st.conv(ch, 2 * ch, 2 * r, r)))
        ch *= 2
    last = st.conv(ch, c["dim"], c["last_kernel"])
    tf = _mimi_transformer(c, B, mk)
    down = st.conv(c["dim"], c["dim"], 2 * c["down"], c["down"])
    proj = mk.lin(c["dim"], c["cb_dim"])
    books = [mk.weight(c["card"], c["cb_dim"]) for _ in range(c["codebooks"])]
    half_norms = [(b.float() * b.float()).sum(-1).mul(0.5).to(b.dtype) for b in books]
    audio = mk.randn(B, 1, c["frame"])

    def frame():
        x = first(audio)
        for res1, res2, dn in blocks:
            x = x + res2(F.elu(res1(F.elu(x))))
            x = dn(F.elu(x))
        x = last(F.elu(x))
        x = down(tf(x.transpose(1, 2)).transpose(1, 2))
        r, codes = x[..., -1] @ proj, []
        for book, hn in zip(books, half_norms):  # residual VQ: the nearest codeword, subtracted, in turn
            i = (r @ book.T - hn).argmax(-1)
            r = r - book[i]
            codes.append(i)
        return codes
    return frame


def _build_mimi_decoder(c: dict, B: int, mk: _Params):
    import torch.nn.functional as F

    st = _Stream(mk, B)
    books = [mk.weight(c["card"], c["cb_dim"]) for _ in range(c["codebooks"])]
    proj = mk.lin(c["cb_dim"], c["dim"])
    up = st.convt(c["dim"], c["dim"], 2 * c["down"], c["down"], groups=c["dim"])  # Mimi's upsampling: channel-wise
    tf = _mimi_transformer(c, B, mk)
    ch = c["filters"] * 2 ** len(c["ratios"])
    first = st.conv(c["dim"], ch, c["kernel"])
    blocks = []
    for r in reversed(c["ratios"]):
        blocks.append((st.convt(ch, ch // 2, 2 * r, r), st.conv(ch // 2, ch // 4, c["res_kernel"]),
                       st.conv(ch // 4, ch // 2, 1)))
        ch //= 2
    last = st.conv(ch, 1, c["kernel"])
    codes = mk.tokens(B, c["codebooks"], high=c["card"])

    def frame():
        e = sum(book[codes[:, q]] for q, book in enumerate(books)) @ proj
        x = up(e.unsqueeze(-1))
        x = first(tf(x.transpose(1, 2)).transpose(1, 2))
        for upc, res1, res2 in blocks:
            x = upc(F.elu(x))
            x = x + res2(F.elu(res1(F.elu(x))))
        return last(F.elu(x))
    return frame


def _build_audio_encoder(c: dict, B: int, mk: _Params):
    import torch.nn.functional as F

    D, H = c["dim"], c["heads"]
    c1, c2 = mk.conv(D, c["mel"], 3), mk.conv(D, D, 3)
    layers = _tf(mk, c["layers"], D, H, H, D // H, c["ffn"], gated=False)
    proj = mk.lin(D, c["out_dim"])
    mel = mk.randn(B, c["mel"], c["frames"])

    def chunk():
        x = F.gelu(F.conv1d(mel, c1, padding=1))
        y = F.gelu(F.conv1d(x, c2, stride=c["stride"], padding=1)).transpose(1, 2)
        for lp in layers:
            y = _block(lp, y)
        return F.rms_norm(y, (D,)) @ proj
    return chunk


def _build_lm_step(c: dict, B: int, mk: _Params):
    """One decode step of a talker / TTS LM (dense or MoE) for B sessions over ``context`` positions of KV."""
    D, H, KVH, hd, C = c["dim"], c["heads"], c["kv_heads"], c["head_dim"], c["context"]
    moe = None
    if c.get("experts"):
        probe = _moe_params(mk, D, c["experts"], c["moe_ffn"], c["topk"])
        moe = {"experts": c["experts"], "ffn": c["moe_ffn"], "topk": c["topk"], "kind": _moe_kind(mk, probe, D)}
        del probe
    layers = _tf(mk, c["layers"], D, H, KVH, hd, c.get("ffn", 0), moe=moe)
    inp, emb, head = mk.lin(c["in_dim"], D), mk.weight(c["vocab"], D), mk.lin(D, c["vocab"])
    caches = [(mk.zeros(B, KVH, C, hd), mk.zeros(B, KVH, C, hd)) for _ in layers]
    h, tok = mk.randn(B, c["in_dim"]), mk.tokens(B, high=c["vocab"])

    def step():
        x = (h @ inp + emb[tok]).unsqueeze(1)
        for lp, (kc, vc) in zip(layers, caches):
            x = _block(lp, x, (kc, vc, C - 1))
        return (x[:, 0] @ head).argmax(-1)
    return step


def _build_code2wav(c: dict, B: int, mk: _Params):
    import torch
    import torch.nn.functional as F

    st = _Stream(mk, B)
    D, H, Q = c["dim"], c["heads"], c["quantizers"]
    table = mk.weight(Q * c["card"], D)
    offsets = torch.arange(Q, device=mk.device) * c["card"]
    layers = _tf(mk, c["layers"], D, H, H, D // H, c["ffn"])
    caches = [(mk.zeros(B, H, c["window"], D // H), mk.zeros(B, H, c["window"], D // H)) for _ in layers]
    ups = [(st.convt(D, D, r, r), st.conv(D, D, 7, groups=D), mk.lin(D, 4 * D), mk.lin(4 * D, D)) for r in c["up"]]
    ch = c["decoder_dim"]
    first = st.conv(D, ch, c["kernel"])
    blocks = []
    for r in c["rates"]:
        units = [(_snake(mk, ch // 2), st.conv(ch // 2, ch // 2, c["kernel"], dil=d), _snake(mk, ch // 2),
                  st.conv(ch // 2, ch // 2, 1)) for d in c["dilations"]]
        blocks.append((_snake(mk, ch), st.convt(ch, ch // 2, 2 * r, r), units))
        ch //= 2
    last_act, last = _snake(mk, ch), st.conv(ch, 1, c["kernel"])
    codes = mk.tokens(B, Q, high=c["card"])

    def frame():
        x = table[codes + offsets].sum(1).unsqueeze(1)  # [B, 1, D]
        for lp, (kc, vc) in zip(layers, caches):
            x = _block(lp, x, (kc, vc, c["window"] - 1))
        x = x.transpose(1, 2)
        for upc, dw, pw1, pw2 in ups:  # ConvTranspose, then a ConvNeXt block
            x = upc(x)
            y = F.rms_norm(dw(x).transpose(1, 2), (D,))
            x = x + (F.gelu(y @ pw1) @ pw2).transpose(1, 2)
        x = first(x)
        for act, upc, units in blocks:
            x = upc(act(x))
            for a1, conv1, a2, conv2 in units:
                x = x + conv2(a2(conv1(a1(x))))
        return last(last_act(x)).clamp(-1, 1)
    return frame


def _amp_stack(mk: _Params, c: dict, cin: int, ch: int, act):
    """A HiFi-GAN/BigVGAN generator over a chunk: conv in to ``ch`` channels, then per upsampling rate a
    transposed conv and the multi-receptive-field block (each kernel's residual chain, averaged)."""
    pre = _conv(mk, cin, ch, 7)
    stages = []
    for r, k in zip(c["rates"], c["up_kernels"]):
        up = _convt(mk, ch, ch // 2, k, r)
        ch //= 2
        mrf = [[(act(mk, ch), _conv(mk, ch, ch, kk, d), act(mk, ch), _conv(mk, ch, ch, kk)) for d in c["dilations"]]
               for kk in c["res_kernels"]]
        stages.append((act(mk, ch * 2), up, mrf))

    def run(x):
        x = pre(x)
        for a0, up, mrf in stages:
            x = up(a0(x))
            acc = 0
            for chain in mrf:
                y = x
                for a1, conv1, a2, conv2 in chain:
                    y = y + conv2(a2(conv1(a1(y))))
                acc = acc + y
            x = acc / len(mrf)
        return x
    return run, ch


def _leaky(mk: _Params, c: int):
    import torch.nn.functional as F

    return lambda x: F.leaky_relu(x, 0.1)


def _build_dit_bigvgan(c: dict, B: int, mk: _Params):
    import torch

    D, T, M = c["dim"], c["frames"], c["mel"]
    G = 2 if c["cfg"] else 1  # classifier-free guidance: the conditional and unconditional passes in one batch
    emb = mk.weight(c["code_vocab"], c["code_dim"])
    inp = mk.lin(2 * M + c["code_dim"], D)
    layers = _tf(mk, c["layers"], D, c["heads"], c["heads"], D // c["heads"], c["ffn"], gated=False, adaln=True)
    out = mk.lin(D, M)
    temb = [mk.randn(G * B, D) for _ in range(c["steps"])]  # each step's time embedding (its MLP not timed)
    codes, cond, noise = mk.tokens(B, c["tokens"], high=c["code_vocab"]), mk.randn(B, T, M), mk.randn(B, T, M)
    vocoder, ch = _amp_stack(mk, c, M, c["channels"], _snake)
    post = _conv(mk, ch, 1, 7)

    def chunk():
        code = emb[codes].repeat_interleave(T // c["tokens"], dim=1)  # the token rate up to the mel rate
        x = noise
        for s in range(c["steps"]):
            y = torch.cat([x, cond, code], -1).repeat(G, 1, 1) @ inp
            for lp in layers:
                y = _block(lp, y, temb=temb[s])
            v = y @ out
            if G == 2:
                vc, vu = v.chunk(2)
                v = vc + 0.5 * (vc - vu)
            x = x + v / c["steps"]
        return torch.tanh(post(vocoder(x.transpose(1, 2))))
    return chunk


def _build_cfm_hift(c: dict, B: int, mk: _Params):
    import torch
    import torch.nn.functional as F

    T, M, ch, G = c["frames"], c["mel"], c["channels"], 2 if c["cfg"] else 1
    E = c["enc_dim"]
    emb = mk.weight(c["vocab"], E)
    enc = _tf(mk, c["enc_layers"], E, c["enc_heads"], c["enc_heads"], E // c["enc_heads"], c["enc_ffn"], gated=False)
    to_mel = mk.lin(E, M)
    inp = _conv(mk, 4 * M, ch, 3)  # x, mu, speaker, prompt condition
    blocks = [((_conv(mk, ch, ch, 3), _conv(mk, ch, ch, 3), mk.lin(ch, ch)),
               _tf(mk, c["tf_per_block"], ch, c["heads"], c["heads"], ch // c["heads"], c["ffn"], gated=False))
              for _ in range(c["blocks"])]
    out = _conv(mk, ch, M, 1)
    temb = [mk.randn(G * B, ch) for _ in range(c["steps"])]
    tokens, spk, prompt, noise = mk.tokens(B, c["tokens"], high=c["vocab"]), mk.randn(B, M, T), mk.randn(B, M, T), \
        mk.randn(B, M, T)
    hift, hch = _amp_stack(mk, c, M, c["hift_channels"], _leaky)
    post = _conv(mk, hch, c["n_fft"] + 2, 7)
    istft = mk.convt(c["n_fft"] + 2, 1, c["n_fft"])

    def chunk():
        y = emb[tokens]
        for lp in enc:
            y = _block(lp, y)
        mu = (y.repeat_interleave(T // c["tokens"], dim=1) @ to_mel).transpose(1, 2)  # [B, M, T]
        x = noise
        for s in range(c["steps"]):
            h = inp(torch.cat([x, mu, spk, prompt], 1).repeat(G, 1, 1))
            for (c1, c2, tproj), tfl in blocks:
                h = h + c2(F.mish(c1(h) + (temb[s] @ tproj).unsqueeze(-1)))
                h = h.transpose(1, 2)
                for lp in tfl:
                    h = _block(lp, h)
                h = h.transpose(1, 2)
            v = out(h)
            if G == 2:
                vc, vu = v.chunk(2)
                v = vc + 0.7 * (vc - vu)
            x = x + v / c["steps"]
        spec = post(F.leaky_relu(hift(x), 0.01))
        return F.conv_transpose1d(spec, istft, stride=c["hop"])[..., :T * int(np.prod(c["rates"])) * c["hop"]]
    return chunk


def _build_moe_ffn(c: dict, B: int, mk: _Params):
    import torch.nn.functional as F

    D = c["dim"]
    probe = _moe_params(mk, D, c["experts"], c["moe_ffn"], c["topk"])
    kind = _moe_kind(mk, probe, D)
    del probe
    layers = [{**_moe_params(mk, D, c["experts"], c["moe_ffn"], c["topk"]), "moe": kind} for _ in range(c["layers"])]
    x0 = mk.randn(B, 1, D)

    def step():
        x = x0
        for lp in layers:
            x = x + _ffn(lp, F.rms_norm(x, (D,)))
        return x
    step.layers, step.x0 = layers, x0
    return step


BUILDERS = {"multi_pass": _build_multi_pass, "mimi_encoder": _build_mimi_encoder,
            "mimi_decoder": _build_mimi_decoder, "audio_encoder": _build_audio_encoder, "lm_step": _build_lm_step,
            "code2wav": _build_code2wav, "dit_bigvgan": _build_dit_bigvgan, "cfm_hift": _build_cfm_hift,
            "moe_ffn": _build_moe_ffn}


def _experts_read(step) -> float:
    """Distinct experts the step's routing picked, averaged over its layers (untimed: a host sync per layer)."""
    import torch
    import torch.nn.functional as F

    x, counts = step.x0, []
    for lp in step.layers:
        h = F.rms_norm(x, (x.shape[-1],))
        flat = h.reshape(-1, h.shape[-1])
        idx = torch.topk(torch.softmax((flat @ lp["router"]).float(), -1), lp["topk"], dim=-1).indices
        counts.append(int(torch.unique(idx).numel()))
        x = x + _ffn(lp, h)
    return float(np.mean(counts))


# --- the H200 plan: a cost model from kernel counts, FLOPs and bytes on the meta device ------------------------

# What run 2 on one H200 timed (docs/measured/decode_step-h200-run2.json and its log): the depformer at batch 1 (CUDA
# graphs, eager), and the compaction check + decode steps before the stage timers (31 s, less the depformer's 5 s,
# which the stage timers time now).
H200_DEPFORMER_B1 = {"graphs": 2.15e-3, "eager": 12.9e-3}
H200_BEFORE_STAGES_S = 26.0
H200_BYTES_PER_S = 3.5e12  # what plain PyTorch streamed weights at there (docs/gpu-pricing.md: ~3.5 of 4.8 TB/s)
H200_FLOPS = 400e12  # an assumed 40% of the 989 TFLOP/s dense bf16 datasheet peak for these mid-sized matmuls/convs
GPU_CHECK_LIMIT_S = 360.0  # issue 47: the whole prepared run in <= 6 min on one H200
# views and allocations launch no kernel
_NO_KERNEL = {"view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand", "unsqueeze",
              "squeeze", "select", "slice", "split", "split_with_sizes", "unbind", "as_strided", "detach", "alias",
              "empty", "empty_strided", "empty_like", "lift_fresh", "chunk", "unflatten", "view_as", "expand_as",
              "sym_size", "sym_stride", "sym_numel", "is_same_size", "result_type"}


def _flops(name: str, args, out) -> float:
    """FLOPs of the ops that do the arithmetic (matmuls, convolutions, grouped GEMMs); 0 for the rest."""
    if name in ("mm", "bmm", "_grouped_mm"):  # [.., m, k] @ [.., k, n]
        return 2.0 * out.numel() * args[0].shape[-1]
    if name in ("addmm", "baddbmm"):
        return 2.0 * out.numel() * args[1].shape[-1]
    if name == "convolution":  # weight [out, in/groups, k...]: each output element sums in/groups · k products
        return 2.0 * out.numel() * args[1][0].numel() if not args[6] else 2.0 * args[0].numel() * args[1][0].numel()
    return 0.0


def _count(fn) -> dict:
    """Kernels, FLOPs and bytes touched (each op's tensor inputs and outputs) by one call of ``fn`` built on the
    meta device."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    tally = {"kernels": 0, "bytes": 0.0, "flops": 0.0}

    def tensors(vs):
        for v in vs:
            if isinstance(v, torch.Tensor):
                yield v
            elif isinstance(v, (tuple, list)):
                yield from (x for x in v if isinstance(x, torch.Tensor))

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name not in _NO_KERNEL:
                tally["kernels"] += 1
                tally["bytes"] += sum(t.numel() * t.element_size()
                                      for t in tensors([*args, *(kwargs or {}).values(), out]))
                tally["flops"] += _flops(name, args, out)
            return out

    with Count():
        fn()
    return tally


def _h200_seconds(cost: dict, launch: dict) -> dict:
    work = cost["flops"] / H200_FLOPS + cost["bytes"] / H200_BYTES_PER_S
    graphs = cost["kernels"] * launch["graphs"] + work
    return {"graphs": graphs, "eager": max(cost["kernels"] * launch["eager"], graphs)}


def _meta_cost(timer: Timer, batch: int) -> dict:
    """:func:`_count` of the full shape at ``batch``. A stage of S sequential steps (ODE steps, codebook passes) is
    counted at 1 and 2 steps and extended in a line: each step launches the same kernels (the passes' attention
    over the frame's few positions so far aside), and counting on the meta device costs a few seconds a
    thousand kernels."""
    import torch

    def count(cfg):
        mk = _Params("meta", torch.bfloat16)
        with torch.no_grad():
            return _count(BUILDERS[timer.kind](cfg, batch, mk.begin()))

    steps = timer.full.get("steps")
    if not steps or steps <= 2:
        return count(timer.full)
    one, two = count({**timer.full, "steps": 1}), count({**timer.full, "steps": 2})
    return {k: one[k] + (steps - 1) * (two[k] - one[k]) for k in one}


def h200_launch_costs() -> dict:
    """Seconds a kernel costs launched from a CUDA graph and eagerly, from the H200 depformer run (its measured
    batch-1 frame less the modelled memory and compute time, over its kernel count)."""
    cost = _meta_cost(TIMERS["moshi-7b"]["depformer"], 1)
    work = cost["flops"] / H200_FLOPS + cost["bytes"] / H200_BYTES_PER_S
    return {mode: max(t - work, 0.0) / cost["kernels"] for mode, t in H200_DEPFORMER_B1.items()}


@dataclass(frozen=True)
class Options:
    """How long each point is timed: ``warmup`` untimed calls, then ``reps`` timed (between ``reps_min`` and
    ``reps_max``, as many as fit in ``point_s``); a point whose one call would take over ``call_cap_s`` is skipped
    (and the larger ones after it); nothing starts once ``budget_s`` is spent."""

    warmup: int = 2
    reps_min: int = 3
    reps_max: int = 20
    point_s: float = 1.0
    call_cap_s: float = 1.0
    budget_s: float = 300.0
    graph_warmup: int = 4  # _graphed's 3 warm-up calls and the capture
    overhead_s: float = 0.05  # Python and allocation per point (the plan's allowance)
    # A point with a graph capture, beyond its calls: the H200 depformer run spent 5.2 s on 6 points whose calls
    # took 2.2 s (docs/measured/decode_step-h200-run2.json), 0.5 s a point (state, capture, instantiation).
    capture_overhead_s: float = 0.5


CUDA_OPTIONS = Options(point_s=0.5, reps_max=10)
CPU_OPTIONS = Options(warmup=1, reps_min=5, reps_max=9, point_s=0.2, call_cap_s=2.0, budget_s=120.0)
GRID = (1, 8, 32, 64, 128, 256)
# One session at a time, B sessions cost B single calls: the small batches give a slow stage's fit its points
# before the per-call cap stops it.
PER_SESSION_GRID = (1, 2, 4, 8, 32, 64, 128, 256)
MOE_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SMALL_GRID, SMALL_MOE_GRID = (1, 2, 4, 8), (1, 2, 4, 8, 16)


def grids(timer: Timer, small: bool) -> dict:
    """The batches each batching is timed at."""
    if timer.kind == "moe_ffn":
        return {"batched": SMALL_MOE_GRID if small else MOE_GRID}
    return {"batched": SMALL_GRID if small else GRID, "per_session": SMALL_GRID if small else PER_SESSION_GRID}


def _reps(opts: Options, t: float) -> int:
    return int(min(opts.reps_max, max(opts.reps_min, opts.point_s // max(t, 1e-9))))


def _point_cost(opts: Options, t: float, warm: int) -> float:
    """Seconds a point costs: ``warm`` untimed calls (warm-up, graph capture), the timed repeats, the overhead."""
    return warm * t + _reps(opts, t) * t + opts.overhead_s


def _warm_calls(opts: Options, batching: str, launch: str, batch: int, first: int) -> int:
    """Untimed calls before a point's repeats, as :func:`measure_timer` makes them: a batched graph is captured
    at each batch; a session's graph once (the batched one at batch 1); past its first point a per-session loop
    repeats a call already warm, so it needs none."""
    if batching == "per_session" and batch != first:
        return 0
    if launch == "graphs":
        return opts.graph_warmup + 1 if batching == "batched" and batch != 1 else 1
    return opts.warmup


def plan_timer(timer: Timer, opts: Options, launch: dict) -> dict:
    """What timing ``timer`` at its full shape and grids costs on an H200: per mode, the modelled seconds per call
    at each batch, the points skipped by ``call_cap_s``, and the total."""
    g = grids(timer, small=False)
    lo, hi = _meta_cost(timer, 1), _meta_cost(timer, g["batched"][-1])

    def at(b):  # kernels do not change with the batch; FLOPs and bytes are affine in it
        f = (b - 1) / max(g["batched"][-1] - 1, 1)
        return {"kernels": lo["kernels"], **{k: lo[k] + f * (hi[k] - lo[k]) for k in ("flops", "bytes")}}

    modes, total = {}, 0.5  # building the weights
    for batching, grid in g.items():
        for launch_mode in ("graphs", "eager"):
            secs, cost, skipped = {}, 0.0, []
            if batching == "batched" and launch_mode == "graphs":
                # the batch-1 capture, and each batch's
                cost += opts.graph_warmup * _h200_seconds(at(1), launch)["graphs"] + opts.capture_overhead_s
            for b in grid:
                call = _h200_seconds(at(b if batching == "batched" else 1), launch)[launch_mode]
                call *= 1 if batching == "batched" else b
                if call > opts.call_cap_s or skipped:
                    skipped.append(b)
                    continue
                secs[b] = call
                cost += _point_cost(opts, call, _warm_calls(opts, batching, launch_mode, b, grid[0]))
                if batching == "batched" and launch_mode == "graphs" and b != 1:
                    cost += opts.capture_overhead_s
            modes[f"{batching}/{launch_mode}"] = {"call_s": secs, "skipped": skipped, "seconds": cost}
            total += cost
    return {"modes": modes, "seconds": total}


def plan(models=None, opts: Options = CUDA_OPTIONS) -> dict:
    """The full run's cost on an H200, per timer and in all, with what gpu_check.sh runs before it."""
    launch = h200_launch_costs()
    timers = {}
    for t in _selected(models):
        timers[f"{t.model} {t.name}"] = plan_timer(t, opts, launch)
    start_s = 10.0  # the process: imports, CUDA context
    stages = start_s + sum(p["seconds"] for p in timers.values())
    return {"launch_s": launch, "timers": timers, "stage_timers_s": stages, "before_s": H200_BEFORE_STAGES_S,
            "total_s": H200_BEFORE_STAGES_S + stages, "limit_s": GPU_CHECK_LIMIT_S}


def _selected(models=None) -> list[Timer]:
    keys = list(TIMERS) if not models else models
    unknown = [k for k in keys if k not in TIMERS]
    if unknown:
        raise MetronomeError(f"unknown model {unknown[0]!r}; choose from {', '.join(TIMERS)}")
    out = [t for k in keys for t in TIMERS[k].values()]
    if BACKBONE.model in keys:
        out.append(BACKBONE)
    return out


# --- the measurement -------------------------------------------------------------------------------------------

class _Clock:
    def __init__(self, budget_s: float, planned_s: float | None):
        self.t0, self.budget_s, self.planned_s = time.perf_counter(), budget_s, planned_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def line(self) -> str:
        plan = f" of {self.planned_s:.0f} s planned" if self.planned_s else ""
        return f"[{self.elapsed():6.1f} s{plan}; budget {self.budget_s:.0f} s]"


def _fit_mode(points: list[dict], terms: dict) -> dict:
    from metronome.probe.decode_step import _fit

    if len({p["batch"] for p in points}) < len(terms):
        return {"fit": None, "why": f"{len(points)} point(s): too few for {len(terms)} terms"}
    out = {"fit": _fit(points, "seconds", terms)}
    low, high = (_fit([{**p, "seconds": p[k]} for p in points], "seconds", terms) for k in ("p10_s", "p90_s"))
    out["range"] = {name: [min(low[name], high[name]), max(low[name], high[name])] for name in terms}
    return out


class _Mode:
    def __init__(self, batching: str, launch: str):
        self.rec = {"batching": batching, "launch": launch, "points": [], "skipped": []}
        self.stopped: str | None = None
        self.last: tuple[int, float] | None = None

    def skip(self, batch: int, why: str) -> None:
        self.rec["skipped"].append({"batch": batch, "why": why})

    def predict(self, batch: int) -> float | None:
        """A bound on one call at ``batch`` from the last point: the time grows at most in proportion."""
        return None if self.last is None else self.last[1] * batch / self.last[0]


def _time_point(mode: _Mode, batch: int, fn, device: str, opts: Options, clock: _Clock, *, predicted=None,
                warm: int | None = None) -> None:
    from metronome.probe.decode_step import _samples

    if mode.stopped:
        return mode.skip(batch, mode.stopped)
    predicted = predicted if predicted is not None else mode.predict(batch)
    if predicted is not None and predicted > opts.call_cap_s:
        mode.stopped = f"one call would take ~{predicted:.2f} s, over the {opts.call_cap_s:g} s cap"
        return mode.skip(batch, mode.stopped)
    if clock.left() < (_point_cost(opts, predicted, 1) if predicted else 0.0):
        mode.stopped = "the run's time budget is spent"
        return mode.skip(batch, mode.stopped)
    try:
        warm = opts.warmup if warm is None else warm
        t = _samples(device, fn, warm)[-1] if warm else predicted or 0.0  # (no warm-up: a loop of a warm call)
        if t > 2 * opts.call_cap_s:
            mode.stopped = f"one call took {t:.2f} s, over the {opts.call_cap_s:g} s cap"
            return mode.skip(batch, mode.stopped)
        xs = _samples(device, fn, _reps(opts, t))
    except RuntimeError as exc:  # out of memory at a large batch, say
        mode.stopped = f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        return mode.skip(batch, mode.stopped)
    med = float(np.median(xs))
    mode.rec["points"].append({"batch": batch, "seconds": med, "p10_s": float(np.percentile(xs, 10)),
                               "p90_s": float(np.percentile(xs, 90)), "reps": len(xs)})
    mode.last = (batch, med)


def measure_timer(timer: Timer, small: bool, device: str, dtype: str, opts: Options, clock: _Clock,
                  seed: int = 0, launches: tuple[str, ...] | None = None) -> dict:
    """Time ``timer`` (its small or full shape) at each batch of its grids in each mode; the points, skips and
    fits per mode. ``launches``: graphs and eager on CUDA, eager elsewhere."""
    import torch

    from metronome.probe.decode_step import _graphed

    cuda = device.startswith("cuda")
    launches = launches or (("graphs", "eager") if cuda else ("eager",))
    cfg, g = (timer.small if small else timer.full), grids(timer, small)
    grid = g["batched"]
    modes = {f"{b}/{la}": _Mode(b, la) for b in g for la in launches}
    mk = _Params(device, getattr(torch, dtype), seed)
    build = BUILDERS[timer.kind]
    extra = {}
    with torch.no_grad():
        one = build(cfg, 1, mk.begin())
        one_graph = None
        for b in grid:
            try:
                fn = one if b == grid[0] == 1 else build(cfg, b, mk.begin())
            except RuntimeError as exc:  # out of memory for a large batch's inputs, say
                for key in modes:
                    if key.startswith("batched/"):
                        modes[key].stopped = modes[key].stopped or f"error: {str(exc).splitlines()[0]}"
                        modes[key].skip(b, modes[key].stopped)
                continue
            _time_point(modes["batched/eager"], b, fn, device, opts, clock,
                        warm=_warm_calls(opts, "batched", "eager", b, grid[0]))
            if "graphs" in launches:
                m = modes["batched/graphs"]
                if not m.stopped and (m.predict(b) or 0.0) <= opts.call_cap_s:
                    graph = _graphed(fn)  # its warm-up calls and the capture: opts.graph_warmup
                    if b == 1:
                        one_graph = graph
                    if graph is None:
                        m.stopped = "CUDA graph capture failed"
                    _time_point(m, b, graph, device, opts, clock, warm=1)
                    del graph
                else:
                    _time_point(m, b, None, device, opts, clock)
            if timer.kind == "moe_ffn" and device != "meta":
                extra.setdefault("experts_read", {})[b] = _experts_read(fn)
            del fn
            if cuda:
                torch.cuda.empty_cache()
        if "per_session" in g:
            t1 = {}
            for la in launches:
                m = modes[f"per_session/{la}"]
                if la == "eager":
                    single = one
                else:  # the batched batch-1 graph is this one; captured here only where that was not
                    single = one_graph or (_graphed(one) if clock.left() > 0 else None)
                    if single is None:
                        m.stopped = ("CUDA graph capture failed" if clock.left() > 0
                                     else "the run's time budget is spent")
                for b in g["per_session"]:
                    loop = (lambda f=single, n=b: [f() for _ in range(n)]) if single else None
                    _time_point(m, b, loop, device, opts, clock, predicted=b * t1[la] if la in t1 else None,
                                warm=_warm_calls(opts, "per_session", la, b, g["per_session"][0]))
                    if la not in t1 and m.rec["points"]:
                        t1[la] = m.rec["points"][0]["seconds"] / m.rec["points"][0]["batch"]
        del one, one_graph, mk
        if cuda:
            torch.cuda.empty_cache()
    out = {"unit": timer.unit, "units_per_s": timer.units_per_s, "passes_per_unit": timer.passes_per_unit,
           "shape": cfg, "shape_note": timer.shape_note, "modes": {}}
    for key, m in modes.items():
        out["modes"][key] = {**m.rec, **_fit_mode(m.rec["points"], FIT_TERMS)}
    if timer.kind == "moe_ffn":
        E, k = cfg["experts"], cfg["topk"]
        terms = {"per_launch_s": lambda p: 1.0, "per_expert_s": lambda p: expected_experts(p["batch"], E, k),
                 "per_session_s": lambda p: p["batch"]}
        for key, m in modes.items():
            for p in m.rec["points"]:
                p["experts_expected"] = expected_experts(p["batch"], E, k)
                if p["batch"] in extra.get("experts_read", {}):
                    p["experts_read"] = extra["experts_read"][p["batch"]]
            out["modes"][key]["experts_fit"] = _fit_mode(m.rec["points"], terms)
    return out


def _summary(name: str, res: dict) -> str:
    parts = []
    for key, m in res["modes"].items():
        f = m.get("fit")
        if f:
            parts.append(f"{key} {f['per_launch_s'] * 1e3:.3f} ms + {f['per_session_s'] * 1e6:.1f} us/session "
                         f"(max err {f['fit_max_abs_rel_error']:.0%}, {len(m['points'])} pts)")
        else:
            parts.append(f"{key}: {m.get('why') or 'no fit'}")
    return f"{name}: " + "; ".join(parts)


def run(device: str, small: bool, out_path: str, models=None, budget_s: float | None = None,
        command: str = "", stages_only: bool = False) -> dict:
    """Time the timers of ``models`` (all by default) and write ``out_path``; ``stages_only``: the pipeline
    stages only, not the MoE backbone's curve (``metronome-probe calibrate`` times the backbone on vLLM itself)."""
    import torch

    from metronome.probe.decode_step import run_provenance

    timers = [t for t in _selected(models) if not (stages_only and t is BACKBONE)]
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise MetronomeError("--device cuda but no CUDA device is visible")
    if not cuda and device != "cpu":
        raise MetronomeError(f"unknown device {device!r}; choose cuda or cpu")
    dtype = "bfloat16" if cuda else "float32"
    opts = CUDA_OPTIONS if cuda else CPU_OPTIONS
    if budget_s is not None:
        opts = Options(**{**opts.__dict__, "budget_s": budget_s})
    clock = _Clock(opts.budget_s, None)
    if cuda and not small:  # the plan's own few seconds count against the budget too
        p = plan(models, opts)
        clock.planned_s = p["stage_timers_s"]
        print(f"stage_timers: planned {clock.planned_s:.0f} s on an H200 for {len(timers)} timers (gpu_check in all "
              f"{p['total_s']:.0f} s of {p['limit_s']:.0f} s); budget {opts.budget_s:.0f} s; plan made in "
              f"{clock.elapsed():.1f} s", flush=True)
    if not cuda:
        print("stage_timers: on a CPU every mode is eager (CUDA graphs need a CUDA device); one thread", flush=True)
    torch.backends.cudnn.benchmark = False  # an autotune per new shape would cost more than the point it times
    prov = run_provenance(device, dtype)
    doc = {"schema": "metronome.stage_timers/1", **prov, "basis": "measured", "shapes": "small" if small else "full",
           "command": command,
           "timing": {"statistic": "median", "warmup": opts.warmup, "reps_min": opts.reps_min,
                      "reps_max": opts.reps_max, "point_s": opts.point_s, "call_cap_s": opts.call_cap_s,
                      "clock": "CUDA events, synchronised after each call" if cuda else "wall clock (perf_counter)",
                      "launches": ["graphs", "eager"] if cuda else ["eager"],
                      "graphs_note": None if cuda else "not timed: CUDA graphs need a CUDA device"},
           "fit": "unit_s = per_launch_s + per_session_s * batch, least squares over the mode's points; range: the "
                  "same fit of each point's 10th and 90th percentile repeat",
           "budget": {"planned_s": clock.planned_s, "budget_s": opts.budget_s}, "failed": [], "models": {}}
    threads = torch.get_num_threads()
    if not cuda:
        # One thread: the small shapes gain nothing from two, and on a shared box a descheduled OpenMP worker
        # stalls the other at every barrier.
        torch.set_num_threads(1)
    try:
        _run_timers(timers, doc, small, device, dtype, opts, clock, out_path)
    finally:
        torch.set_num_threads(threads)
    print(f"stage_timers: {len(timers)} timers in {clock.elapsed():.1f} s; wrote {out_path}", flush=True)
    return doc


# --- measured stage terms: a stack priced from a stages.json -----------------------------------------------------

TIMED_BATCHING = {BATCHED: "batched", PER_SESSION: "per_session"}  # metronome.models' words -> the file's


def timing_mode(mode: Mode) -> str:
    """The key of a stage record's ``modes`` that times a stack's :class:`~metronome.models.Mode`."""
    return f"{TIMED_BATCHING[mode.batching]}/{mode.launch}"


def _mode_fit(doc: dict, model_key: str, timer: str, key: str) -> dict:
    """The fit (and its range) of one timer's mode in ``doc``; ValueError saying why there is none."""
    rec = doc.get("models", {}).get(model_key, {}).get("stages", {}).get(timer)
    if rec is None:
        raise ValueError(f"{model_key}: the timings have no stage {timer!r}")
    if "error" in rec:
        raise ValueError(f"{model_key} {timer}: its timer failed ({rec['error']})")
    m = rec["modes"].get(key)
    if m is None:
        timed = ", ".join(rec["modes"]) or "none"
        raise ValueError(f"{model_key} {timer}: mode {key} was not timed (timed: {timed}; "
                         f"{doc.get('timing', {}).get('graphs_note') or 'see the file'})")
    if not m.get("fit"):
        raise ValueError(f"{model_key} {timer}: mode {key} has no fit ({m.get('why') or 'no points'})")
    return {**m, "units_per_s": rec["units_per_s"], "unit": rec["unit"]}


def stage_terms(model_key: str, stack: Stack | str, timings: dict, frame_period_s: float,
                steps_per_frame: int) -> tuple[StepTerm, ...]:
    """The step terms of ``model_key``'s pipeline stages as ``stack`` runs them, from measured ``timings`` (a
    ``stages.json`` document, docs/measured/README.md), basis ``measured``, for a stream of ``steps_per_frame``
    backbone steps every ``frame_period_s``.

    Each stage adds two terms (:func:`metronome.roofline.folded_stage_terms`): the fit's launch part per step and
    its per-session part per sequence, each summed over the stage's timers and folded into a step as
    :func:`metronome.roofline.fold_stage` folds every stage (``units_per_s · frame_period_s / steps_per_frame``
    units a step; the session's part for the stage's ``duty``). A fit's slightly negative part is noise about zero and is priced 0. The range is the same fold of
    the mode's ``range`` (the fits of the 10th and 90th percentile repeats), widened to hold the value. The
    source names the device, PyTorch, the date, the dtype, the shapes and the mode. ValueError when a stage's mode
    was not timed (on a CPU, CUDA graphs) or has no fit."""
    from metronome.roofline import fold_stage, folded_stage_terms, units_per_step

    model = MODELS[model_key]
    if isinstance(stack, str):
        stack = next((s for s in STACKS[model_key] if s.name == stack), None) or _unknown_stack(model_key, stack)
    where = (f"{timings.get('device')}, torch {timings.get('torch')}"
             + (f", CUDA {timings['cuda']}, driver {timings.get('driver')}" if timings.get("cuda") else "")
             + f", {timings.get('measured_at')}, {timings.get('dtype')}, {timings.get('shapes')} shapes")
    pipeline = timings.get("models", {}).get(model_key, {}).get("pipeline", {})
    out = []
    for st in model.pipeline:
        mode = stack.mode(st.name)
        key = timing_mode(mode)
        names = pipeline.get(st.name) or timers_for(model_key, st.name)
        launch = [0.0, 0.0, 0.0]  # value, low, high
        session = [0.0, 0.0, 0.0]
        parts = []
        for name in names:
            m = _mode_fit(timings, model_key, name, key)
            units = units_per_step(m["units_per_s"] * frame_period_s, steps_per_frame)
            fit, rng = m["fit"], m.get("range") or {}
            for i, pick in enumerate((lambda k: fit[k], lambda k: min(rng.get(k, [fit[k]])),
                                      lambda k: max(rng.get(k, [fit[k]])))):
                base, per = fold_stage(units, st.duty, max(pick("per_launch_s"), 0.0),
                                       max(pick("per_session_s"), 0.0))
                launch[i] += base
                session[i] += per
            parts.append(f"{name} ({m['unit']}; {fit['per_launch_s'] * 1e6:.4g} us a launch + "
                         f"{fit['per_session_s'] * 1e6:.4g} us a session, {units:g} a step)")
        src = (f"{st.source}; measured ({key}): {' + '.join(parts)}; {st.duty:g} duty on the per-session part; "
               f"{where}; range: the fits of the 10th and 90th percentile repeats")
        out += folded_stage_terms(st, mode, tuple(launch), tuple(session), "measured", src)
    return tuple(out)


def _unknown_stack(model_key: str, name: str):
    raise ValueError(f"{model_key} has no stack {name!r} (stacks: {', '.join(s.name for s in STACKS[model_key])})")


def _run_timers(timers, doc: dict, small: bool, device: str, dtype: str, opts: Options, clock: _Clock,
                out_path: str) -> None:
    failed = doc["failed"]  # timers that raised: their entry holds the error
    for t in timers:
        entry = doc["models"].setdefault(t.model, {"pipeline": {}, "untimed": [], "stages": {}})
        if not entry["pipeline"] and t.model in MODELS:
            for st in MODELS[t.model].pipeline:
                try:
                    entry["pipeline"][st.name] = timers_for(t.model, st.name)
                except KeyError as exc:
                    entry["pipeline"][st.name] = None
                    entry["untimed"].append(st.name)
                    print(f"stage_timers: {exc.args[0]}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            res = measure_timer(t, small, device, dtype, opts, clock)
        except Exception as exc:  # noqa: BLE001 - one timer's bug must not cost a GPU run the timers after it
            traceback.print_exc()
            res = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            failed.append(f"{t.model} {t.name}")
        res["seconds"] = round(time.perf_counter() - t0, 2)
        if t.kind == "moe_ffn":
            entry["backbone"] = {t.name: res}
        else:
            entry["stages"][t.name] = res
        line = _summary(t.name, res) if "modes" in res else f"{t.name}: {res['error']}"
        print(f"{clock.line()} {t.model} {line}; {res['seconds']:.1f} s", flush=True)
        doc["budget"]["elapsed_s"] = round(clock.elapsed(), 1)
        with open(out_path, "w") as f:  # after every timer: a run cut short keeps what it measured
            json.dump(doc, f, indent=1)


def _print_plan(p: dict) -> None:
    ls = p["launch_s"]
    print(f"H200 plan (per kernel: {ls['graphs'] * 1e6:.1f} us from a CUDA graph, {ls['eager'] * 1e6:.1f} us eager, "
          f"from the depformer run; {H200_FLOPS / 1e12:.0f} TFLOP/s, {H200_BYTES_PER_S / 1e12:.1f} TB/s):")
    for name, t in p["timers"].items():
        modes = ", ".join(f"{k} {m['seconds']:.1f} s" + (f" (skips B {m['skipped']})" if m["skipped"] else "")
                          for k, m in t["modes"].items())
        print(f"  {name}: {t['seconds']:.1f} s: {modes}")
    print(f"stage timers {p['stage_timers_s']:.0f} s + compaction and decode steps {p['before_s']:.0f} s "
          f"(docs/measured) = {p['total_s']:.0f} s of {p['limit_s']:.0f} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="stage_timers", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--small", action="store_true", help="small shapes and grid (CPU, CI): checks every timer runs")
    ap.add_argument("--out", help="JSON file to write (stages.json)")
    ap.add_argument("--models", default=None, help=f"comma-separated models (default: all of {', '.join(TIMERS)})")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting points after this many seconds")
    ap.add_argument("--plan", action="store_true", help="print the full run's H200 time plan and exit (runs nothing)")
    args = ap.parse_args(argv)
    models = args.models.split(",") if args.models else None
    if args.plan:
        _print_plan(plan(models))
        return 0
    if not args.out:
        raise MetronomeError("--out is required (or --plan)")
    doc = run(args.device, args.small, args.out, models, args.budget_s,
              command=" ".join(["stage_timers", *sys.argv[1:]]))
    if doc["failed"]:
        print(f"stage_timers: {len(doc['failed'])} timer(s) failed: {', '.join(doc['failed'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_command("stage_timers", main))
