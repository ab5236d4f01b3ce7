"""The one table of the real-time interaction models Metronome knows: shape, KV arithmetic, real-time stream,
weights, frame pipeline, the serving stacks that run it (:data:`STACKS`) and the backbone a vLLM engine loads for
them.

Both readers take it from here: :mod:`metronome.roofline` prices each model on each GPU (the ``estimated``
presets in ``calibration/``, regenerated from this table), and ``metronome-probe --model NAME`` loads each
backbone's HF config with random weights (``--weights dummy``) to calibrate it live. Each entry's ``source``
says where its numbers come from (docs/gpu-pricing.md lists them).
"""

from __future__ import annotations

from dataclasses import dataclass

from metronome.calibration import ModelShape, TokenStream


# How a serving stack runs a stage (:class:`Mode`): batched across the sessions of a backbone step (each launch a
# fixed cost plus a cost per session in it) or one session at a time (every session pays a launch); its kernels
# replayed from CUDA graphs or launched one by one (eager)
BATCHED, PER_SESSION = "batched", "per-session"
GRAPHS, EAGER = "graphs", "eager"


@dataclass(frozen=True)
class Mode:
    """How a stack runs one stage: ``batching`` (:data:`BATCHED` or :data:`PER_SESSION`) and ``launch``
    (:data:`GRAPHS` or :data:`EAGER`)."""

    batching: str = BATCHED
    launch: str = GRAPHS

    def __post_init__(self):
        if self.batching not in (BATCHED, PER_SESSION) or self.launch not in (GRAPHS, EAGER):
            raise ValueError(f"a stage runs batched or per-session, with graphs or eager: got {self}")

    @property
    def label(self) -> str:
        how = "batched across the step's sessions" if self.batching == BATCHED else "one session at a time"
        return f"{how}, {'CUDA graphs' if self.launch == GRAPHS else 'eager'}"


@dataclass(frozen=True)
class Stage:
    """One part of a model's frame pipeline besides the backbone vLLM serves, on the same GPU.

    ``decode``: an autoregressive or iterative generator (talker, code predictor, depformer, codec, vocoder ODE
    steps) taking ``rate`` sequential forward passes per second while it runs. ``encode``: an encoder over ``rate``
    positions per second of its input, run once per frame on the frame's input, its work priced by its matmuls
    (2·``params`` per position). ``duty`` is the share of a conversation it runs (speech out: the assistant's share
    of the talk). ``layers``: the sequential layers one pass (decode) or one call (encode) runs, which sets what a
    launch costs when the work is too small to fill the GPU (:mod:`metronome.roofline` prices each :class:`Mode`)."""

    name: str
    kind: str  # "decode" | "encode"
    rate: float
    duty: float
    source: str
    params: float = 0.0  # encode only
    layers: int = 0


@dataclass(frozen=True)
class Stack:
    """A serving stack: how it runs each stage of a model's pipeline (``modes``: stage name → :class:`Mode`), what
    it is (``description``) and what that reading is based on (``source``). The backbone is vLLM's in every stack."""

    name: str
    description: str
    modes: tuple[tuple[str, Mode], ...]
    source: str

    def mode(self, stage: str) -> Mode:
        return dict(self.modes)[stage]


def moe_route_of(config: dict) -> float:
    """k/E of a backbone config's MoE layers (``num_experts_per_tok`` of ``num_experts``), 0 for a dense one."""
    return config["num_experts_per_tok"] / config["num_experts"] if config.get("num_experts") else 0.0


@dataclass(frozen=True)
class Model:
    key: str  # the presets' stem: calibration/{key}-{gpu}.json
    probe_name: str  # metronome-probe --model NAME
    description: str
    shape: ModelShape
    stream: TokenStream
    backbone_config: dict  # the HF config of the backbone (same layers, heads, head dim, MoE) vLLM loads
    weight_bytes: float  # all weights resident on the device (encoders and talker included)
    streamed_weight_bytes: float  # the backbone's weights a decode step can read (an MoE's routed experts among
    # them, of which a step reads only a share: expert_bytes)
    source: str
    stream_note: str
    pipeline: tuple[Stage, ...] = ()
    hub_id: str | None = None  # where vLLM can load the real model, if it can

    @property
    def moe_route(self) -> float:
        """k/E of the backbone's MoE layers (0: dense): the share of its experts one token reads."""
        return moe_route_of(self.backbone_config)

    @property
    def expert_bytes(self) -> float:
        """Bytes of every routed expert of every layer (bf16; 0 for a dense backbone): gate, up and down
        projections of ``moe_intermediate_size`` each."""
        c = self.backbone_config
        if not c.get("num_experts"):
            return 0.0
        return c["num_hidden_layers"] * c["num_experts"] * 3 * c["hidden_size"] * c["moe_intermediate_size"] * 2


def hf_config(arch: str, model_type: str, **kw) -> dict:
    """An HF config.json for a decoder of this architecture: the defaults every backbone here shares, then ``kw``."""
    base = dict(architectures=[arch], model_type=model_type, hidden_act="silu", rms_norm_eps=1e-6,
                rope_theta=1_000_000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
                bos_token_id=0, eos_token_id=1, attention_bias=False)
    base.update(kw)
    return base


SPEECH_DUTY = 0.5  # half-duplex models speak for about half of a conversation (assumed)
# Qwen3-Omni's speech side per second of speech: 12.5 talker steps, 15 code-predictor passes per codec frame,
# 12.5 Code2Wav frames (Qwen3-Omni's 12.5 Hz codec, 16 codebooks, MTP for codebooks 1-15)
QWEN3_OMNI_SPEECH_PASSES_PER_S = 12.5 + 15 * 12.5 + 12.5

MODELS: dict[str, Model] = {m.key: m for m in [
    Model(
        "moshi-7b", "moshi", "Moshi 7B temporal transformer as Llama-style MHA (32 layers, 32 heads, head_dim 128)",
        ModelShape("Moshi 7B (temporal transformer)", layers=32, kv_heads=32, head_dim=128, kv_dtype="bf16",
                   max_model_len_tokens=65536, params=7.7e9, active_params=7.7e9),
        TokenStream(frame_period_s=0.08, input_tokens_per_frame=0, output_tokens_per_frame=1),
        # Moshi's temporal transformer is plain MHA (kv_repeat=1) with RoPE and a gated FFN of
        # int(2/3·4.125·4096) = 11264; a Llama config has exactly that shape. Moshi's own server keeps a
        # 3000-step ring (a 240 s window without sinks); served by vLLM, the context is what the engine allows.
        hf_config("LlamaForCausalLM", "llama", hidden_size=4096, intermediate_size=11264, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=32, head_dim=128, vocab_size=32000,
             max_position_embeddings=65536, rope_theta=10000.0),
        weight_bytes=15.4e9, streamed_weight_bytes=15.4e9,
        source="kyutai-labs/moshi configs/moshi_7b_202409.json: dim 4096, 32 heads, 32 layers, kv_repeat 1 (MHA), bf16",
        stream_note="12.5 Hz: one fused text+audio KV position per 80 ms frame (input folded into the decode step)",
        pipeline=(
            Stage("depformer", "decode", 8 / 0.08, 1.0,
                  "8 sequential depformer steps per 80 ms frame (6 layers, dim 1024), every frame: full duplex",
                  layers=6),
            Stage("Mimi encoder + decoder", "decode", 2 / 0.08, 1.0,
                  "one streaming Mimi encoder and one decoder pass per 80 ms frame (each an 8-layer transformer and "
                  "a SEANet convolution stack: about 12 layers' launches, assumed)", layers=12),
        ),
    ),
    Model(
        "qwen2.5-omni-7b", "qwen2.5-omni", "Qwen2.5-Omni-7B thinker (Qwen2: 28 layers, 28 q / 4 kv heads, head_dim 128)",
        ModelShape("Qwen2.5-Omni-7B (thinker)", layers=28, kv_heads=4, head_dim=128, kv_dtype="bf16",
                   max_model_len_tokens=32768, params=10.7e9, active_params=7.6e9),
        TokenStream(frame_period_s=2.0, input_tokens_per_frame=50, output_tokens_per_frame=4),
        hf_config("Qwen2ForCausalLM", "qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
             num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
             attention_bias=True),
        weight_bytes=21.4e9, streamed_weight_bytes=15.2e9,
        source="transformers qwen2_5_omni configuration: thinker hidden 3584, 28 layers, 28 heads, 4 KV heads, head_dim 128",
        stream_note="25 audio tokens/s in TMRoPE 2 s chunks: 50 input tokens per 2 s frame, 4 text tokens out",
        pipeline=(
            Stage("audio encoder", "encode", 50.0, 1.0,
                  "Whisper-large-v3-style encoder (~0.64B params, 32 layers) over 50 positions/s before pooling to 25 "
                  "tokens/s", params=0.64e9, layers=32),
            Stage("talker", "decode", 50.0, SPEECH_DUTY, "talker: ~50 codec tokens per second of speech (24 layers, hidden 896)",
                  layers=24),
            Stage("token2wav", "decode", 11.0, SPEECH_DUTY,
                  "DiT flow matching (10 ODE steps) plus one BigVGAN pass per second of speech (assumed chunking; "
                  "22 DiT layers a pass, assumed)", layers=22),
        ),
        hub_id="Qwen/Qwen2.5-Omni-7B",
    ),
    Model(
        "qwen3-omni-30b-a3b", "qwen3-omni",
        "Qwen3-Omni-30B-A3B thinker (Qwen3-MoE: 48 layers, 32 q / 4 kv heads, 128 experts, 8 active)",
        ModelShape("Qwen3-Omni-30B-A3B (thinker)", layers=48, kv_heads=4, head_dim=128, kv_dtype="bf16",
                   max_model_len_tokens=65536, params=35e9, active_params=3.3e9),
        TokenStream(frame_period_s=1.0, input_tokens_per_frame=13, output_tokens_per_frame=2),
        hf_config("Qwen3MoeForCausalLM", "qwen3_moe", hidden_size=2048, intermediate_size=6144,
             moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
             head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
             mlp_only_layers=[], vocab_size=152064, max_position_embeddings=65536),
        weight_bytes=70e9, streamed_weight_bytes=61e9,
        source="Qwen3-Omni thinker = Qwen3-30B-A3B attention: 48 layers, 32 heads, 4 KV heads, head_dim 128, 128 experts / 8 active",
        stream_note="13 audio tokens/s (12.5 Hz encoder) per 1 s frame, 2 text tokens out",
        pipeline=(
            Stage("audio encoder", "encode", 25.0, 1.0, "AuT encoder (~0.6B params, 32 layers) over 25 positions/s "
                  "before the 2x downsampling to 12.5 Hz", params=0.6e9, layers=32),
            # the three speech stages share one anchor (ANCHORS speech: their passes together)
            Stage("talker", "decode", 12.5, SPEECH_DUTY, "MoE talker (~3B total, 0.3B active, 20 layers): 12.5 steps "
                  "per second of speech", layers=20),
            Stage("code predictor", "decode", 15 * 12.5, SPEECH_DUTY, "multi-token code predictor (5 layers): 15 "
                  "passes per 12.5 Hz codec frame", layers=5),
            Stage("Code2Wav", "decode", 12.5, SPEECH_DUTY, "causal ConvNet codec decoder: 12.5 frames per second of "
                  "speech (about 8 layers' launches a frame, assumed)", layers=8),
        ),
        hub_id="Qwen/Qwen3-Omni-30B-A3B-Instruct",
    ),
    Model(
        "minicpm-o-4.5", "minicpm-o", "MiniCPM-o 4.5 LLM (Qwen3-8B: 36 layers, 32 q / 8 kv heads, head_dim 128)",
        ModelShape("MiniCPM-o 4.5 (Qwen3-8B LLM)", layers=36, kv_heads=8, head_dim=128, kv_dtype="bf16",
                   max_model_len_tokens=40960, params=9e9, active_params=8.2e9),
        TokenStream(frame_period_s=1.0, input_tokens_per_frame=12, output_tokens_per_frame=8),
        hf_config("Qwen3ForCausalLM", "qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
             max_position_embeddings=40960),
        weight_bytes=18e9, streamed_weight_bytes=16.4e9,
        source="MiniCPM-o 4.5 = Qwen3-8B LLM: 36 layers, 32 heads, 8 KV heads, head_dim 128",
        stream_note="1 Hz duplex unit: <unit> + 10 audio tokens + markers in, ~8 speak tokens out on average",
        pipeline=(
            Stage("audio encoder", "encode", 50.0, 1.0, "Whisper-medium encoder (~0.3B params, 24 layers) over 50 "
                  "frames/s", params=0.3e9, layers=24),
            Stage("TTS LM", "decode", 25.0, SPEECH_DUTY, "CosyVoice2-style TTS LM (Qwen2.5-0.5B-sized, 24 layers): "
                  "25 speech tokens per second of speech", layers=24),
            Stage("flow-matching vocoder", "decode", 10.0, SPEECH_DUTY,
                  "flow matching (10 ODE steps) per second of speech (assumed chunking; 16 layers a step, assumed)",
                  layers=16),
        ),
        hub_id="openbmb/MiniCPM-o-4_5",
    ),
]}


# --------------------------------------------------------------------------------------------------
# Serving stacks: how a stack runs each model's stages. The first of each model's is its default (docs/presets.md
# says why): every stage batched with CUDA graphs, as vLLM runs the backbone.

def _all(model_key: str, mode: Mode) -> tuple[tuple[str, Mode], ...]:
    return tuple((st.name, mode) for st in MODELS[model_key].pipeline)


def _batched_graphs(model_key: str) -> Stack:
    return Stack("batched-graphs", "every stage batched across the step's sessions and replayed from CUDA graphs, as "
                 "vLLM runs the backbone", _all(model_key, Mode(BATCHED, GRAPHS)),
                 "vLLM's own way with the backbone (continuous batching, CUDA graphs at padded batch sizes); the "
                 "stages built the same way (vllm-project/vllm-omni PR #7734 captures PersonaPlex's depformer so, keyed by "
                 "padded batch)")


_OMNI_EAGER = ("vLLM-Omni's staged pipeline: the thinker stage, then the speech stages as engines of their own, each "
               "batching its requests")
STACKS: dict[str, tuple[Stack, ...]] = {
    "moshi-7b": (
        _batched_graphs("moshi-7b"),
        Stack("vllm-omni-duplex", "vLLM-Omni's unified duplex path for PersonaPlex (a Moshi fine-tune) as "
              "RFC #7389 traces it: the backbone batched; the depformer and the Mimi codec once per session, eager",
              (("depformer", Mode(PER_SESSION, EAGER)), ("Mimi encoder + decoder", Mode(PER_SESSION, EAGER))),
              "vllm-project/vllm-omni RFC #7389 (PersonaPlex multi-session serving on the unified duplex path): a "
              "per-session Mimi codec from a free-list, batched Mimi and depformer CUDA graphs proposed, not merged; "
              "its 100-tick trace of main at max_sessions 2 counts 3,072 kernel launches per depformer call, one "
              "eager depformer per session; PR #7734 (depformer graphs) open"),
    ),
    "qwen2.5-omni-7b": (
        _batched_graphs("qwen2.5-omni-7b"),
        Stack("vllm-omni", _OMNI_EAGER + ", all eager", _all("qwen2.5-omni-7b", Mode(BATCHED, EAGER)),
              "vllm-project/vllm-omni stage_configs/qwen2_5_omni.yaml: thinker, talker and code2wav (token2wav) "
              "stages, enforce_eager: true on each"),
    ),
    "qwen3-omni-30b-a3b": (
        _batched_graphs("qwen3-omni-30b-a3b"),
        Stack("vllm-omni", _OMNI_EAGER + ", all eager", _all("qwen3-omni-30b-a3b", Mode(BATCHED, EAGER)),
              "vllm-project/vllm-omni stage_configs/qwen3_omni_moe.yaml: thinker, talker (with its code predictor) "
              "and code2wav stages, enforce_eager: true on each"),
    ),
    "minicpm-o-4.5": (
        _batched_graphs("minicpm-o-4.5"),
        Stack("vllm-omni", _OMNI_EAGER + "; the TTS LM with CUDA graphs, the encoder and the vocoder eager",
              (("audio encoder", Mode(BATCHED, EAGER)), ("TTS LM", Mode(BATCHED, GRAPHS)),
               ("flow-matching vocoder", Mode(BATCHED, EAGER))),
              "vllm-project/vllm-omni stage_configs/minicpmo.yaml: thinker stage enforce_eager: true (\"we only "
              "support eager mode\"), talker enforce_eager: false, code2wav enforce_eager: true"),
    ),
}
