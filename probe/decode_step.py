"""A decode step of each preset's backbone, timed in plain PyTorch: ``python -m metronome.probe.decode_step``.

What a GPU does per decode step of a real-time session, without vLLM (the GPU machine this is meant for has
PyTorch but no vLLM and no network): one decoder layer of the preset's shape (``probe.models.PRESETS``: the
attention projections, attention over each sequence's KV of ``C`` tokens with grouped KV heads, and the dense
MLP or the routed MoE with its top-k experts), with random bf16 weights, timed over a batch × context grid and
multiplied by the layer count, plus the LM head. The fit ``step = base + per_seq·B + per_context_token·B·C``
is the term the presets can cite (``scripts/gpu_check.sh`` writes it to ``gpu_check/decode_step.json``).

What it leaves out, by design: vLLM's own per-step cost (scheduling, sampling, the Python between steps) and
paged-kernel details (the attention here reads contiguous KV: the same bytes a paged kernel reads). So it is a
floor for the model's compute and memory traffic, a measured anchor beside the datasheet roofline. The rest of each
model's frame pipeline (Moshi's depformer and Mimi, the talkers, the vocoders) and the MoE's curve in batch are
timed by ``metronome.probe.stage_timers``.
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
        # Expert weights stored [E, out, in] as nn.Linear keeps them, seen as [E, in, out]: the layout grouped
        # GEMM kernels read.
        p.update(router=w(h, e), gate_up=w(e, 2 * f, h).transpose(-2, -1), down=w(e, h, f).transpose(-2, -1),
                 topk=cfg["num_experts_per_tok"], moe="grouped")
    else:
        f = cfg["intermediate_size"]
        p.update(gate_up=w(h, 2 * f), down=w(f, h))
    return p


def _moe_loop(p: dict, x, wts, idx):
    """Each chosen expert once, over its tokens: data-dependent (a host sync per step), so eager only."""
    import torch
    import torch.nn.functional as F

    out = torch.zeros_like(x)
    for e in torch.unique(idx).tolist():
        rows, slot = (idx == e).nonzero(as_tuple=True)
        a, b = (x[rows] @ p["gate_up"][e]).chunk(2, -1)
        out.index_add_(0, rows, ((F.silu(a) * b) @ p["down"][e]) * wts[rows, slot, None].to(x.dtype))
    return out


def _moe_grouped(p: dict, x, wts, idx):
    """The same MoE as one grouped GEMM per projection over the tokens sorted by expert: static shapes and no
    host sync, so a CUDA graph can hold it, and only the chosen experts' weights are read (as a fused MoE
    kernel does)."""
    import torch
    import torch.nn.functional as F

    k, E = idx.shape[1], p["gate_up"].shape[0]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.searchsorted(flat[order], torch.arange(E, device=x.device), right=True).to(torch.int32)
    rows = order // k
    a, b = torch._grouped_mm(x[rows], p["gate_up"], offs=offs).chunk(2, -1)
    y = torch._grouped_mm((F.silu(a) * b).contiguous(), p["down"], offs=offs)
    return torch.zeros_like(x).index_add_(0, rows, y * wts.reshape(-1)[order, None].to(x.dtype))


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
        wts, idx = torch.topk(torch.softmax((x @ p["router"]).float(), -1), p["topk"], dim=-1)
        return x + (_moe_grouped if p["moe"] == "grouped" else _moe_loop)(p, x, wts, idx)
    a, b = (x @ p["gate_up"]).chunk(2, -1)
    return x + (F.silu(a) * b) @ p["down"]


def _choose_moe(p: dict, x) -> str:
    """None for a dense MLP; for an MoE, grouped if this torch has it and it agrees with the loop on this device
    (bf16: 2% of the output's scale, a few roundings of 2^-8), else the loop."""
    import torch

    if "router" not in p:
        return None
    if not hasattr(torch, "_grouped_mm"):
        return "loop"
    with torch.no_grad():
        wts, idx = torch.topk(torch.softmax((x @ p["router"]).float(), -1), p["topk"], dim=-1)
        want = _moe_loop(p, x, wts, idx).float()
        try:
            got = _moe_grouped(p, x, wts, idx).float()
        except RuntimeError:
            return "loop"
    return "grouped" if float((got - want).abs().max()) <= 0.02 * float(want.abs().max()) + 1e-6 else "loop"


def _samples(device: str, fn, reps: int) -> list[float]:
    """Seconds each of ``reps`` calls of ``fn`` took: CUDA events on a GPU (the GPU's own clock, launch gaps
    included, synchronised after each call), the wall clock on a CPU."""
    import torch

    times = []
    for _ in range(reps):
        if device.startswith("cuda"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def _timer(device: str, reps: int):
    """time(fn) -> median seconds of ``reps`` calls (:func:`_samples`)."""
    return lambda fn: float(np.median(_samples(device, fn, reps)))


def run_provenance(device: str, dtype: str) -> dict:
    """What a measurement file says about where and when it was taken: the device, its driver (nvidia-smi's,
    None where there is none), PyTorch and its CUDA, the date (UTC) and the dtype."""
    import shutil
    import subprocess

    import torch

    cuda = device.startswith("cuda")
    driver = None
    if cuda and shutil.which("nvidia-smi"):
        try:
            res = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            driver = res.stdout.strip().splitlines()[0] if res.returncode == 0 and res.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            driver = None
    return {"device": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine() or "cpu",
            "driver": driver, "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "dtype": dtype}


def _graphed(fn):
    """``fn`` captured in a CUDA graph (as vLLM runs decode steps), or None where capture fails."""
    import torch

    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):  # warm-up off the capture stream, as torch.cuda.graphs asks
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g.replay
    except RuntimeError:
        return None


def _fit(points, key, terms: dict) -> dict:
    """Least squares of ``point[key]`` on ``terms`` (name -> the term's input at a point), and its worst relative
    error: a stage's own terms (:mod:`metronome.probe.stage_timers`)."""
    A = np.array([[f(p) for f in terms.values()] for p in points], dtype=float)
    y = np.array([p[key] for p in points])
    coef, *_ = np.linalg.lstsq(A, y, rcond=None)
    return {**{name: float(c) for name, c in zip(terms, coef)},
            "fit_max_abs_rel_error": float(np.max(np.abs(A @ coef - y) / y))}


def _step_fit(points, key, cfg: dict) -> dict:
    """The simulator's step model (:func:`metronome.fit.fit_points`: every coefficient, the MoE input for a
    backbone that routes) fitted to ``point[key]`` over the grid, and its worst relative error."""
    from metronome.fit import fit_points
    from metronome.models import moe_route_of

    b = np.array([p["batch"] for p in points], float)
    c = np.array([p["context"] for p in points], float)
    coef, err = fit_points(b, b * c, b, [p[key] for p in points], moe_route_of(cfg))
    return {**coef, "fit_max_abs_rel_error": float(np.max(np.abs(err)))}


def measure(cfg: dict, batches, contexts, device: str = "cpu", dtype: str = "bfloat16", reps: int = 20,
            seed: int = 0) -> dict:
    """Median time of one decode step (all layers + LM head) at each (B, C), and the least-squares fit.

    On CUDA each point is timed twice: eager (one launch per op, as the plugin's eager mode runs) and replayed
    from a CUDA graph (as vLLM runs decode steps by default). ``step_s`` is the graph's time where capture
    worked, and the fit is of ``step_s``; ``eager_step_s`` and ``eager_fit`` stand beside it."""
    import torch

    dt = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    layer = _layer(cfg, device, dt, gen)
    h, kvh = cfg["hidden_size"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    lm_head = torch.randn(h, cfg["vocab_size"], device=device, dtype=dt, generator=gen) * 0.02
    cuda = device.startswith("cuda")
    timed = _timer(device, reps)
    points = []
    with torch.no_grad():
        layer["moe"] = _choose_moe(layer, torch.randn(64, h, device=device, dtype=dt, generator=gen))
        for B in batches:
            for C in contexts:
                k = torch.randn(B, kvh, C, d, device=device, dtype=dt, generator=gen)
                v = torch.randn(B, kvh, C, d, device=device, dtype=dt, generator=gen)
                x = torch.randn(B, h, device=device, dtype=dt, generator=gen)

                def step_layer(x=x, k=k, v=v):
                    return _forward(layer, x, k, v)

                def step_head(x=x):
                    return (x @ lm_head).argmax(-1)

                for _ in range(2):  # warm-up (kernels, allocator)
                    step_layer(), step_head()
                eager = timed(step_layer) * cfg["num_hidden_layers"] + timed(step_head)
                point = {"batch": B, "context": C, "step_s": eager, "eager_step_s": eager, "graph": False}
                graph_layer, graph_head = (_graphed(step_layer), _graphed(step_head)) if cuda else (None, None)
                if graph_layer and graph_head:
                    point.update(step_s=timed(graph_layer) * cfg["num_hidden_layers"] + timed(graph_head),
                                 graph=True)
                points.append(point)
                del k, v, graph_layer, graph_head
                if cuda:
                    torch.cuda.empty_cache()
    return {"points": points, "moe": layer.get("moe"), **_step_fit(points, "step_s", cfg),
            "eager_fit": _step_fit(points, "eager_step_s", cfg)}


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
    if not args.device.startswith("cuda"):
        # One thread: the small shape gains nothing from two, and on a shared box a descheduled OpenMP worker
        # stalls the other at every barrier (stage_timers does the same).
        torch.set_num_threads(1)
    if args.small:
        shapes = {"small": SMALL}
        batches, contexts, dtype = (1, 4), (64, 256), "float32"
    else:
        names = args.presets.split(",") if args.presets else list(PRESETS)
        unknown = [n for n in names if n not in PRESETS]
        if unknown:
            print(f"decode_step: error: unknown preset {unknown[0]!r}; choose from {', '.join(PRESETS)}",
                  file=sys.stderr)
            return 2
        shapes = {n: PRESETS[n].hf_config for n in names}
        batches, contexts, dtype = (1, 8, 32, 64, 128, 256), (512, 2048, 8192), "bfloat16"
    out = {**run_provenance(args.device, dtype),
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
        if "error" in res:
            line = f"{name}: {res['error']}"
        else:
            mode = "CUDA graphs" if all(p["graph"] for p in res["points"]) else "eager"
            e = res["eager_fit"]
            experts = f", all experts {res['moe_experts_s'] * 1e3:.3f} ms" if res["moe_experts_s"] else ""
            line = (f"{name} ({mode}{', MoE ' + res['moe'] if res['moe'] else ''}): base {res['base_s'] * 1e3:.3f} ms, "
                    f"per seq {res['per_seq_s'] * 1e6:.2f} us, per context token "
                    f"{res['per_context_token_s'] * 1e9:.3f} ns, per token of the mean sequence's context "
                    f"{res['per_mean_context_token_s'] * 1e9:.3f} ns{experts} "
                    f"(fit max err {res['fit_max_abs_rel_error']:.0%}); "
                    f"eager base {e['base_s'] * 1e3:.3f} ms, per seq {e['per_seq_s'] * 1e6:.2f} us, per context token "
                    f"{e['per_context_token_s'] * 1e9:.3f} ns; {res['seconds']:.0f} s")
        print(line, flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
