"""Sweep the weight-only NVFP4 kernel's split-K (forced per run, and the launcher's own choice)
against bf16 cuBLAS on the Llama-3-8B projections: GPU time of a CUDA graph, weights cycled past
L2 as in ``bench decode``.

    python benchmarks/weight_only_sweep.py [--fmt nvfp4|fp8] [--ms 1,4,16] [--shapes 6144x4096,...] [--splits 1,2,4,8]
        [--max-stages 8] [--ctas-per-sm 2] [--warp-mma-max 8] [--after-op]

``--after-op``: each call takes its ``x`` from an elementwise torch kernel just before it (``x * 1``),
as in a model, where a norm or an activation precedes each projection: a kernel cannot then overlap
its start with the previous call's end (programmatic dependent launch), as back-to-back calls of
the weight-only kernel do.
"""

from __future__ import annotations

import argparse
import math

import torch

from lowprec import quantize
from lowprec.bench.common import bench_graph_ms
from lowprec.bench.decode import ROTATE_BYTES, SHAPES
from lowprec.gemm.sm90 import weight_only_interface as wo
from lowprec.gemm.weight_only import pack_fp8, pack_nvfp4
from lowprec.recipes import get_recipe


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="1,4,16")
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="N x K, comma-separated")
    p.add_argument("--splits", default="1,2,4,8")
    p.add_argument("--fmt", default="nvfp4", choices=("nvfp4", "fp8"))
    p.add_argument("--max-stages", type=int, default=None, help="override the ring depth cap")
    p.add_argument("--ctas-per-sm", type=int, default=None, help="override the resident CTAs per SM at tile_m <= 32")
    p.add_argument("--warp-mma-max", type=int, default=None,
                   help="override the widest tile_m on mma.sync for --fmt (0: none)")
    p.add_argument("--after-op", action="store_true", help="an elementwise kernel before each call (as in a model)")
    args = p.parse_args()
    if args.warp_mma_max is not None:
        wo.WARP_MMA_MAX_TILE_M = {**wo.WARP_MMA_MAX_TILE_M, args.fmt: args.warp_mma_max}
        wo.compile_kernel.cache_clear()
    if args.ctas_per_sm is not None:
        wo.ctas_per_sm = lambda tile_m, c=args.ctas_per_sm: c if tile_m <= 32 else 1
        wo.compile_kernel.cache_clear()
    if args.max_stages is not None:
        wo._MAX_STAGES = args.max_stages
        wo.compile_kernel.cache_clear()
    ms = [int(v) for v in args.ms.split(",")]
    fresh = (lambda x: x * 1) if args.after_op else (lambda x: x)  # noqa: E731
    chosen = wo.choose_split
    grid = [int(v) for v in args.splits.split(",")] + ["auto"]
    ratios = {g: [] for g in grid}
    for n, k in [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        q = quantize(w, get_recipe("nvfp4" if args.fmt == "nvfp4" else "fp8_block128x128"))
        bytes_per_weight, run = (0.5625, wo.weight_only_nvfp4) if args.fmt == "nvfp4" else (1.0, wo.weight_only_fp8)
        copies = max(1, math.ceil(ROTATE_BYTES / (n * k * bytes_per_weight)))
        if args.fmt == "nvfp4":
            packs = [pack_nvfp4(q.data.clone(), q.scale.clone(), q.global_scale) for _ in range(copies)]
        else:
            packs = [pack_fp8(q.data.clone(), q.scale.clone()) for _ in range(copies)]
        bf16 = [w.clone() for _ in range(max(1, math.ceil(ROTATE_BYTES / (n * k * 2))))]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf16 = bench_graph_ms(lambda x=x, ws=bf16: [fresh(x) @ b.t() for b in ws]) * 1e3 / len(bf16)
            line = [f"{n}x{k} M={m}: bf16 {t_bf16:6.1f} us"]
            for g in grid:
                wo.choose_split = chosen if g == "auto" else (lambda *args, g=g: g)
                t = bench_graph_ms(lambda x=x, run=run, ps=packs: [run(fresh(x), pk) for pk in ps]) * 1e3 / len(packs)
                ratios[g].append(t_bf16 / t)
                line.append(f"s{g} {t:6.1f} us {t_bf16 / t:4.2f}x {n * k * bytes_per_weight / t / 1e3:5.0f} GB/s")
            print(" | ".join(line), flush=True)
    for g, r in ratios.items():
        print(f"splits {g}: geomean x bf16 {math.exp(sum(map(math.log, r)) / len(r)):.2f}")


if __name__ == "__main__":
    main()
