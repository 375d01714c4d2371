"""``python -m lowprec bench quant``: FP8 quantize kernels vs the copy ceiling and plain torch.

Bytes counted: the input read once, the FP8 output(s) and FP32 scales written once. The torch
peer is lowprec's reference quantizer (plain torch ops) on the same GPU. Every input is larger
than L2, so calls are timed back to back, not with an L2 flush: GPU time from a CUDA graph of
back-to-back calls, and beside it the time per call of back-to-back eager calls (``eager us``:
includes the Python launch path wherever that is slower than the kernel).

``% copy after GEMM``: each kernel timed right after an FP8 8192³ GEMM, as it runs inside a
training step, where the GEMMs hold the chip at its power cap and the SM clock drops; the kernels
that do more work per byte slow down there (the copy itself does not: its line shows that).
"""

from __future__ import annotations

import argparse
import os

import torch

from ..gemm import gemm
from ..quant import quantize, quantize_dual
from .common import bench_graph_ms, bench_ms, bench_stream_ms, copy_bandwidth_gbs, print_table, save_results

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


def _timed(kind: str, x: torch.Tensor, backend: str, timer=bench_graph_ms) -> float:
    old = os.environ.get("LOWPREC_BACKEND")
    os.environ["LOWPREC_BACKEND"] = backend
    try:
        return timer(lambda: _run(kind, x))
    finally:
        if old is None:
            del os.environ["LOWPREC_BACKEND"]
        else:
            os.environ["LOWPREC_BACKEND"] = old


def _after(hot):
    """Timer: GPU ms of a call queued right after ``hot()`` (see ``bench_ms``'s ``before``)."""
    return lambda fn: bench_ms(fn, warmup=3, rep=30, queued=True, before=hot)


def _gemm_8192():
    """An FP8 GEMM of ~1 ms (8192³, 1x128 x 128x128 scales): the work a quantize kernel follows
    in a training step."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a = quantize(torch.randn(8192, 8192, device="cuda", generator=g), "fp8_block1x128")
    b = quantize(torch.randn(8192, 8192, device="cuda", generator=g), "fp8_block128x128")
    return lambda: gemm(a, b, out_dtype=torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowprec bench quant", description=__doc__)
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/<gpu>.json)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench quant needs a CUDA GPU")
    copy = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy:.0f} GB/s (read + write)")
    hot = _gemm_8192()
    rows, records = [], []
    for m, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        copy_after = 2 * x.numel() * x.element_size() / _after(hot)(lambda x=x, y=y: y.copy_(x)) / 1e6
        rows.append([f"{m}x{k}", "copy", "", "", "", 100 * copy_after / copy, "", "", ""])
        for kind in ("1x128", "rowwise", "128x128", "dual"):
            ms = _timed(kind, x, "kernel")
            ms_eager = _timed(kind, x, "kernel", bench_stream_ms)
            ms_torch = _timed(kind, x, "reference", bench_stream_ms)  # the reference is not graph-capturable
            ms_hot = _timed(kind, x, "kernel", _after(hot))
            gbs = _bytes(m, k, kind) / ms / 1e6
            pct_hot = 100 * _bytes(m, k, kind) / ms_hot / 1e6 / copy
            rows.append([f"{m}x{k}", kind, ms * 1e3, gbs, 100 * gbs / copy, pct_hot, ms_eager * 1e3, ms_torch * 1e3,
                         ms_torch / ms])
            records.append({"shape": [m, k], "kind": kind, "us": ms * 1e3, "gbs": gbs, "pct_copy": 100 * gbs / copy,
                            "us_after_gemm": ms_hot * 1e3, "pct_copy_after_gemm": pct_hot,
                            "eager_us": ms_eager * 1e3, "torch_us": ms_torch * 1e3, "speedup_vs_torch": ms_torch / ms})
        records.append({"shape": [m, k], "kind": "copy", "pct_copy_after_gemm": 100 * copy_after / copy})
    print_table(["shape (bf16)", "kernel", "lowprec us", "GB/s", "% copy", "% copy after GEMM", "eager us", "torch us",
                 "x torch"], rows)
    path = save_results("quant", {"device": torch.cuda.get_device_name(), "copy_gbs": copy, "rows": records},
                        args.out)
    print(f"saved {path}")
    return 0
