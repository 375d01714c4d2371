"""Sweep the weight-only NVFP4 kernel's split-K choice (GPU time, CUDA graph, weights cycled past
L2 as in ``bench decode``) against bf16 cuBLAS on the Llama-3-8B projections.

    python benchmarks/weight_only_sweep.py [--ms 1,4,16] [--waves 2,4] [--min-chunks 2,4]
"""

from __future__ import annotations

import argparse
import math

import torch

from lowprec import quantize
from lowprec.bench.common import bench_graph_ms
from lowprec.bench.decode import ROTATE_BYTES, SHAPES
from lowprec.gemm.sm90 import weight_only_interface as wo
from lowprec.gemm.weight_only import pack_nvfp4
from lowprec.recipes import get_recipe


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="1,4,16")
    p.add_argument("--waves", default="4")
    p.add_argument("--min-chunks", default="2")
    args = p.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    grid = [(int(w), int(c)) for w in args.waves.split(",") for c in args.min_chunks.split(",")]
    ratios = {g: [] for g in grid}
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        q = quantize(w, get_recipe("nvfp4"))
        copies = max(1, math.ceil(ROTATE_BYTES / (n * k * 0.5625)))
        packs = [pack_nvfp4(q.data.clone(), q.scale.clone(), q.global_scale) for _ in range(copies)]
        bf16 = [w.clone() for _ in range(max(1, math.ceil(ROTATE_BYTES / (n * k * 2))))]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf16 = bench_graph_ms(lambda: [x @ b.t() for b in bf16]) * 1e3 / len(bf16)
            line = [f"{n}x{k} M={m}: bf16 {t_bf16:6.1f} us"]
            for waves, min_chunks in grid:
                wo._WAVES, wo._MIN_CHUNKS_PER_CTA = waves, min_chunks
                t = bench_graph_ms(lambda: [wo.weight_only_nvfp4(x, pk) for pk in packs]) * 1e3 / len(packs)
                per, splits = wo.choose_split(packs[0].n_tiles * -(-m // wo.choose_tile_m(m)), packs[0].k_chunks,
                                              torch.cuda.get_device_properties(0).multi_processor_count
                                              * wo.ctas_per_sm(wo.choose_tile_m(m)))
                ratios[(waves, min_chunks)].append(t_bf16 / t)
                line.append(f"w{waves}c{min_chunks} (s{splits}) {t:6.1f} us {t_bf16 / t:4.2f}x "
                            f"{n * k * 0.5625 / t / 1e3:5.0f} GB/s")
            print(" | ".join(line), flush=True)
    for g, r in ratios.items():
        print(f"waves {g[0]} min chunks {g[1]}: geomean x bf16 {math.exp(sum(map(math.log, r)) / len(r)):.2f}")


if __name__ == "__main__":
    main()
