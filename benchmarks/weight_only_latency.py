"""Where the weight-only kernel's time goes at small N: GPU time per call (CUDA graph of
back-to-back calls, weights cycled past L2) as the chunks per CTA and the CTAs per launch vary.

    python benchmarks/weight_only_latency.py [--fmt nvfp4|fp8]

Rows:
- K sweep at N = 4096, one and two splits: each CTA walks K / 128 / splits chunks one after
  another, 64 or 128 CTAs (at most one per SM), so the slope is one chunk's serial time per CTA
  and the intercept the fixed cost of a call;
- N sweep at K = 4096, one split: 32 chunks per CTA, 16..528 CTAs;
- split sweep at 4096 x 4096;
- ``chained``: each call's output is the next call's input (N = K), as consecutive layers of a
  decode step run, against ``independent`` calls on one input.
"""

from __future__ import annotations

import argparse
import math

import torch

from lowprec import quantize
from lowprec.bench.common import bench_graph_ms
from lowprec.bench.decode import ROTATE_BYTES
from lowprec.gemm.sm90 import weight_only_interface as wo
from lowprec.gemm.weight_only import pack_fp8, pack_nvfp4
from lowprec.recipes import get_recipe


def _packs(fmt: str, n: int, k: int):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    q = quantize(w, get_recipe("nvfp4" if fmt == "nvfp4" else "fp8_block128x128"))
    per_weight = 0.5625 if fmt == "nvfp4" else 1.0
    copies = max(2, math.ceil(ROTATE_BYTES / (n * k * per_weight)))
    if fmt == "nvfp4":
        return [pack_nvfp4(q.data.clone(), q.scale.clone(), q.global_scale) for _ in range(copies)], per_weight
    return [pack_fp8(q.data.clone(), q.scale.clone()) for _ in range(copies)], per_weight


def _time(fmt: str, n: int, k: int, m: int, splits, chained: bool = False) -> str:
    packs, per_weight = _packs(fmt, n, k)
    run = wo.weight_only_nvfp4 if fmt == "nvfp4" else wo.weight_only_fp8
    chosen = wo.choose_split
    wo.choose_split = chosen if splits == "auto" else (lambda *args: splits)
    try:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        if chained:
            def fn():
                y = x
                for pk in packs:
                    y = run(y, pk)
        else:
            def fn():
                for pk in packs:
                    run(x, pk)
        us = bench_graph_ms(fn, reps=4) * 1e3 / len(packs)
    finally:
        wo.choose_split = chosen
    ctas = -(-n // 64) * (splits if splits != "auto" else 0)
    return (f"{fmt} N={n:5d} K={k:5d} M={m:3d} splits={splits!s:4} ctas={ctas or '-':>4} "
            f"chunks/cta={k // 128 // (splits if splits != 'auto' else 1):3d}{' chained' if chained else ''}: "
            f"{us:6.2f} us  {n * k * per_weight / us / 1e3:5.0f} GB/s")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fmt", default="nvfp4", choices=("nvfp4", "fp8"))
    args = p.parse_args()
    f = args.fmt
    for splits in (1, 2):
        for k in (256, 512, 1024, 2048, 4096, 8192, 16384):
            print(_time(f, 4096, k, 1, splits), flush=True)
    for n in (1024, 2048, 4096, 8448, 16896, 33792):
        print(_time(f, n, 4096, 1, 1), flush=True)
    for s in (1, 2, 4, "auto"):
        print(_time(f, 4096, 4096, 1, s), flush=True)
    for m in (1, 16):
        print(_time(f, 4096, 4096, m, "auto"), flush=True)
        print(_time(f, 4096, 4096, m, "auto", chained=True), flush=True)
    default_stages = wo._MAX_STAGES
    for stages in (4, 16):
        wo._MAX_STAGES = stages
        wo.compile_kernel.cache_clear()
        print(f"ring depth cap {stages}:")
        for s in (1, "auto"):
            print(_time(f, 4096, 4096, 1, s), flush=True)
        print(_time(f, 4096, 16384, 1, 1), flush=True)
    wo._MAX_STAGES = default_stages
    wo.compile_kernel.cache_clear()


if __name__ == "__main__":
    main()
