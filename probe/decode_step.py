"""A decode step of each preset's backbone, timed in plain PyTorch: ``python -m metronome.probe.decode_step``.

What a GPU does per decode step of a real-time session, without vLLM (the GPU machine this is meant for has
PyTorch but no vLLM and no network): one decoder layer of the preset's shape (``probe.models.PRESETS``: the
attention projections, attention over each sequence's KV of ``C`` tokens with grouped KV heads, and the dense
MLP or the routed MoE with its top-k experts), with random bf16 weights, timed over a batch × context grid and
multiplied by the layer count, plus the LM head. The fit ``step = base + per_seq·B + per_context_token·B·C``
is the term the presets can cite (``scripts/gpu_check.sh`` writes it to ``gpu_check/decode_step.json``).

What it leaves out, by design: vLLM's own per-step cost (scheduling, sampling, the Python between steps) and
paged-kernel details (the attention here reads contiguous KV: the same bytes a paged kernel reads). So it is a
floor for the model's compute and memory traffic, a measured anchor beside the datasheet roofline.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone

import numpy as np

from metronome.errors import MetronomeError

SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000}


def _layer(cfg: dict, device, dtype, gen):
    import torch

    h, nh, kvh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // nh

    def w(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen) * 0.02

    p = {"qkv": w(h, (nh + 2 * kvh) * d), "o": w(nh * d, h), "nh": nh, "kvh": kvh, "d": d}
    if cfg.get("num_experts"):
        e, f = cfg["num_experts"], cfg["moe_intermediate_size"]
        p.update(router=w(h, e), gate_up=w(e, h, 2 * f), down=w(e, f, h), topk=cfg["num_experts_per_tok"])
    else:
        f = cfg["intermediate_size"]
        p.update(gate_up=w(h, 2 * f), down=w(f, h))
    return p


def _forward(p: dict, x, k_cache, v_cache):
    """One decode step of one layer for B sequences: x [B, h]; caches [B, kvh, C, d]."""
    import torch
    import torch.nn.functional as F

    B = x.shape[0]
    nh, kvh, d = p["nh"], p["kvh"], p["d"]
    qkv = x @ p["qkv"]
    q = qkv[:, : nh * d].view(B, nh, 1, d)
    q = q.view(B, kvh, nh // kvh, d)  # grouped: each KV head serves nh/kvh query heads
    att = F.scaled_dot_product_attention(q, k_cache, v_cache)  # [B, kvh, g, d]
    x = x + att.reshape(B, nh * d) @ p["o"]
    if "router" in p:
        logits = x @ p["router"]
        wts, idx = torch.topk(torch.softmax(logits.float(), -1), p["topk"], dim=-1)
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():  # each chosen expert once, over its tokens (memory-bound)
            rows, slot = (idx == e).nonzero(as_tuple=True)
            gu = x[rows] @ p["gate_up"][e]
            a, b = gu.chunk(2, -1)
            out.index_add_(0, rows, ((F.silu(a) * b) @ p["down"][e]) * wts[rows, slot, None].to(x.dtype))
        return x + out
    gu = x @ p["gate_up"]
    a, b = gu.chunk(2, -1)
    return x + (F.silu(a) * b) @ p["down"]


def measure(cfg: dict, batches, contexts, device: str = "cpu", dtype: str = "bfloat16", reps: int = 5,
            seed: int = 0) -> dict:
    """Median time of one decode step (all layers + LM head) at each (B, C), and the least-squares fit."""
    import torch

    dt = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    layer = _layer(cfg, device, dt, gen)
    h, kvh = cfg["hidden_size"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    lm_head = torch.randn(h, cfg["vocab_size"], device=device, dtype=dt, generator=gen) * 0.02
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    points = []
    for B in batches:
        for C in contexts:
            k = torch.randn(B, kvh, C, d, device=device, dtype=dt, generator=gen)
            v = torch.randn(B, kvh, C, d, device=device, dtype=dt, generator=gen)
            x = torch.randn(B, h, device=device, dtype=dt, generator=gen)
            with torch.no_grad():
                for _ in range(2):  # warm-up (kernels, allocator)
                    _forward(layer, x, k, v)
                sync()
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    _forward(layer, x, k, v)
                    sync()
                    t1 = time.perf_counter()
                    (x @ lm_head).argmax(-1)
                    sync()
                    times.append((t1 - t0) * cfg["num_hidden_layers"] + (time.perf_counter() - t1))
            points.append({"batch": B, "context": C, "step_s": float(np.median(times))})
            del k, v
    A = np.array([[1.0, p["batch"], p["batch"] * p["context"]] for p in points])
    y = np.array([p["step_s"] for p in points])
    coef, *_ = np.linalg.lstsq(A, y, rcond=None)
    fit = A @ coef
    return {"points": points, "base_s": float(coef[0]), "per_seq_s": float(coef[1]),
            "per_context_token_s": float(coef[2]),
            "fit_max_abs_rel_error": float(np.max(np.abs(fit - y) / y))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m metronome.probe.decode_step", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--small", action="store_true", help="a small shape and grid (CPU, CI): checks the code runs")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--presets", default=None, help="comma-separated preset names (default: all)")
    args = ap.parse_args(argv)
    import torch

    from metronome.probe.models import PRESETS

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("decode_step: error: --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    if args.small:
        shapes = {"small": SMALL}
        batches, contexts, dtype = (1, 4), (64, 256), "float32"
    else:
        names = args.presets.split(",") if args.presets else list(PRESETS)
        unknown = [n for n in names if n not in PRESETS]
        if unknown:
            print(f"decode_step: error: unknown preset {unknown[0]!r}; choose from {', '.join(PRESETS)}", file=sys.stderr)
            return 2
        shapes = {n: PRESETS[n].hf_config for n in names}
        batches, contexts, dtype = (1, 8, 32, 64), (512, 2048, 8192), "bfloat16"
    device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor() or "cpu"
    out = {"device": device_name, "torch": torch.__version__, "dtype": dtype,
           "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "what": "one decode step in plain PyTorch: all layers (attention over contiguous KV, MLP or MoE) + LM head; "
                   "no vLLM scheduling or sampling", "models": {}}
    for name, cfg in shapes.items():
        t0 = time.perf_counter()
        try:
            res = measure(cfg, batches, contexts, device=args.device, dtype=dtype)
        except (RuntimeError, MetronomeError) as exc:  # e.g. out of memory at the largest point
            res = {"error": str(exc).splitlines()[0]}
        res["seconds"] = round(time.perf_counter() - t0, 1)
        out["models"][name] = res
        line = (f"{name}: base {res['base_s'] * 1e3:.3f} ms, per seq {res['per_seq_s'] * 1e6:.2f} us, per context token "
                f"{res['per_context_token_s'] * 1e9:.3f} ns (fit max err {res['fit_max_abs_rel_error']:.0%}; "
                f"{res['seconds']:.0f} s)" if "error" not in res else f"{name}: {res['error']}")
        print(line, flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
