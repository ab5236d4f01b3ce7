"""Measure the two roofline constants the estimated presets take from datasheets: HBM bandwidth and
dense bf16 matmul rate.

    python benchmarks/gpu_roofline.py [--device cuda] [--gib 8] [--json out.json]

Prints achieved bandwidth (a device-to-device copy of a large buffer: bytes read + bytes written per
second) and bf16 TFLOP/s (square matmuls), best of several timed repeats after warm-up, with the device
name. ``metronome.roofline`` uses datasheet figures (H200: 4.8 TB/s, 989 TFLOP/s); a measured file can
replace them: pass ``--json`` and cite it in the preset's notes. Needs torch; runs on CPU for a smoke
test (``--device cpu``), where the numbers mean nothing for a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _sync(torch, device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(torch, device, fn, repeats: int) -> float:
    fn()
    _sync(torch, device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(torch, device)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gib", type=float, default=8.0, help="copy buffer size (GiB)")
    ap.add_argument("--matmul", type=int, default=8192, help="square matmul size")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("gpu_roofline: needs torch", file=sys.stderr)
        return 2
    dev = a.device
    if dev.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_roofline: no CUDA device here (use --device cpu for a smoke test)", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(dev) if dev.startswith("cuda") else "cpu"
    n = int(a.gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    t_copy = _time(torch, dev, lambda: dst.copy_(src), a.repeats)
    bandwidth = 2 * src.numel() * 2 / t_copy  # read + write
    del src, dst
    m = a.matmul
    x = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    y = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    t_mm = _time(torch, dev, lambda: x @ y, a.repeats)
    flops = 2 * m**3 / t_mm
    out = {"device": name, "torch": torch.__version__, "hbm_bytes_per_s": bandwidth, "bf16_flops": flops,
           "copy_gib": a.gib, "matmul_n": m, "repeats": a.repeats}
    print(f"{name}: copy {bandwidth / 1e12:.2f} TB/s (read+write), bf16 matmul {flops / 1e12:.1f} TFLOP/s "
          f"(n={m}, best of {a.repeats})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
