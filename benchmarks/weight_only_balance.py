"""Is the weight-only decode kernel's one-split time set by the busiest SM (whole 64-row tiles per
SM), or by the bytes? Times M = 1 at K = 4096 over N giving 1, 2, 3, 3.39 (28672, the Llama-3-8B
gate/up) and 4 tiles per SM on 132 SMs, one split (CUDA graph, weights cycled past L2 as in
``bench decode``), and prints µs, µs per tile per SM of the busiest SM, and GB/s.
    python benchmarks/weight_only_balance.py [--fmt nvfp4|fp8] [--k 4096]
"""

from __future__ import annotations

import argparse
import math

import torch

from lowprec import quantize
from lowprec.bench.common import bench_graph_ms
from lowprec.bench.decode import rotation_copies
from lowprec.gemm.sm90 import weight_only_interface as wo
from lowprec.gemm.weight_only import TILE_N, pack_fp8, pack_nvfp4
from lowprec.recipes import get_recipe


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fmt", default="nvfp4", choices=("nvfp4", "fp8"))
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--tiles", default="132,264,396,448,528")
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wo.choose_split = lambda *a: 1
    for tiles in [int(t) for t in args.tiles.split(",")]:
        n, k = tiles * TILE_N, args.k
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        q = quantize(w, get_recipe("nvfp4" if args.fmt == "nvfp4" else "fp8_block128x128"))
        bpw, run = (0.5625, wo.weight_only_nvfp4) if args.fmt == "nvfp4" else (1.0, wo.weight_only_fp8)
        copies = rotation_copies(n * k * bpw)
        if args.fmt == "nvfp4":
            packs = [pack_nvfp4(q.data.clone(), q.scale.clone(), q.global_scale) for _ in range(copies)]
        else:
            packs = [pack_fp8(q.data.clone(), q.scale.clone()) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        t = bench_graph_ms(lambda x=x, ps=packs, run=run: [run(x, pk) for pk in ps]) * 1e3 / len(packs)
        busiest = math.ceil(tiles / sms)
        print(f"{args.fmt} N={n} K={k} tiles {tiles} ({tiles / sms:.2f}/SM, busiest {busiest}): {t:6.2f} us, "
              f"{t / busiest:5.2f} us per tile of the busiest SM, {n * k * bpw / t / 1e3:5.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
