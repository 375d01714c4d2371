"""``python -m lowprec bench quant``: FP8 quantize kernels vs the copy ceiling and plain torch.

Bytes counted: the input read once, the FP8 output(s) and FP32 scales written once. The torch
peer is lowprec's reference quantizer (plain torch ops) on the same GPU. Every input is larger
than L2, so calls are timed back to back, not with an L2 flush: GPU time from a CUDA graph of
back-to-back calls, and beside it the time per call of back-to-back eager calls (``eager us``:
includes the Python launch path wherever that is slower than the kernel).
"""

from __future__ import annotations

import argparse
import os

import torch

from ..quant import quantize, quantize_dual
from .common import bench_graph_ms, bench_stream_ms, copy_bandwidth_gbs, print_table, save_results

SHAPES = [(16384, 4096), (16384, 14336), (8192, 8192), (4096, 14336)]


def _bytes(m: int, k: int, kind: str) -> int:
    x = 2 * m * k
    if kind == "1x128":
        return x + m * k + 4 * m * -(-k // 128)
    if kind == "128x128":
        return x + m * k + 4 * -(-m // 128) * -(-k // 128)
    if kind == "rowwise":
        return x + m * k + 4 * m
    return x + 2 * m * k + 4 * (m * -(-k // 128) + k * -(-m // 128))


def _run(kind: str, x: torch.Tensor):
    if kind == "dual":
        return quantize_dual(x)
    recipe = {"1x128": "fp8_block1x128", "128x128": "fp8_block128x128", "rowwise": "fp8_rowwise"}[kind]
    return quantize(x, recipe, check_finite=False)


def _timed(kind: str, x: torch.Tensor, backend: str, graph: bool = True) -> float:
    old = os.environ.get("LOWPREC_BACKEND")
    os.environ["LOWPREC_BACKEND"] = backend
    try:
        return (bench_graph_ms if graph else bench_stream_ms)(lambda: _run(kind, x))
    finally:
        if old is None:
            del os.environ["LOWPREC_BACKEND"]
        else:
            os.environ["LOWPREC_BACKEND"] = old


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowprec bench quant", description=__doc__)
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/<gpu>.json)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench quant needs a CUDA GPU")
    copy = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy:.0f} GB/s (read + write)")
    rows, records = [], []
    for m, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for kind in ("1x128", "rowwise", "128x128", "dual"):
            ms = _timed(kind, x, "kernel")
            ms_eager = _timed(kind, x, "kernel", graph=False)
            ms_torch = _timed(kind, x, "reference", graph=False)  # the reference is not graph-capturable
            gbs = _bytes(m, k, kind) / ms / 1e6
            rows.append([f"{m}x{k}", kind, ms * 1e3, gbs, 100 * gbs / copy, ms_eager * 1e3, ms_torch * 1e3,
                         ms_torch / ms])
            records.append({"shape": [m, k], "kind": kind, "us": ms * 1e3, "gbs": gbs, "pct_copy": 100 * gbs / copy,
                            "eager_us": ms_eager * 1e3, "torch_us": ms_torch * 1e3, "speedup_vs_torch": ms_torch / ms})
    print_table(["shape (bf16)", "kernel", "lowprec us", "GB/s", "% copy", "eager us", "torch us", "x torch"], rows)
    path = save_results("quant", {"device": torch.cuda.get_device_name(), "copy_gbs": copy, "rows": records},
                        args.out)
    print(f"saved {path}")
    return 0
