"""A/B of the weight-only kernel against another tree's (e.g. the last commit's), same process,
interleaved rounds: GPU time of a CUDA graph of back-to-back calls, weights cycled past L2 as in
``bench decode``.

    git archive HEAD lowprec | tar -x -C /tmp/old && mv /tmp/old/lowprec /tmp/old/lowprec_old
    python benchmarks/weight_only_ab.py --old /tmp/old [--fmt nvfp4|fp8] [--ms 1,4,16] [--splits auto|1,2,4]
        [--rounds 3] [--match bits|close] [--b-warp-mma-max N]

Prints per shape, M and split the two times and B's ratio over A (A: the old tree); last, the
geomean of each over bf16 cuBLAS at the launcher's own split. Before timing, the two outputs must
be equal bit for bit (``--match bits``) or, for a change that sums in another order (``close``),
within twice the kernel's own bound (each is within bf16 rounding of the exact product).
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys

import torch

from lowprec import quantize
from lowprec.bench.common import bench_graph_ms
from lowprec.bench.decode import ROTATE_BYTES, SHAPES
from lowprec.gemm.sm90 import weight_only_interface as new_wo
from lowprec.gemm.weight_only import pack_fp8, pack_nvfp4
from lowprec.recipes import get_recipe


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--old", required=True, help="a directory holding the other tree as package lowprec_old")
    p.add_argument("--fmt", default="nvfp4", choices=("nvfp4", "fp8"))
    p.add_argument("--ms", default="1,4,16")
    p.add_argument("--splits", default="auto", help="'auto' (the launcher's choice) or a comma list to force")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--match", default="bits", choices=("bits", "close"))
    p.add_argument("--b-warp-mma-max", type=int, default=None,
                   help="B (this tree): the widest tile_m of --fmt on mma.sync (0: none)")
    args = p.parse_args()
    if args.b_warp_mma_max is not None:
        new_wo.WARP_MMA_MAX_TILE_M = {**new_wo.WARP_MMA_MAX_TILE_M, args.fmt: args.b_warp_mma_max}
    sys.path.insert(0, args.old)
    old_wo = importlib.import_module("lowprec_old.gemm.sm90.weight_only_interface")
    old_pack = importlib.import_module("lowprec_old.gemm.weight_only")
    impls = {"A": old_wo, "B": new_wo}
    # each tree packs with its own packer: the packed layout may differ between them
    packers = {"A": (old_pack.pack_nvfp4, old_pack.pack_fp8), "B": (pack_nvfp4, pack_fp8)}
    splits = [None] if args.splits == "auto" else [int(v) for v in args.splits.split(",")]
    choose = {name: wo.choose_split for name, wo in impls.items()}
    ratios = {"A": [], "B": []}
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        q = quantize(w, get_recipe("nvfp4" if args.fmt == "nvfp4" else "fp8_block128x128"))
        per_weight = 0.5625 if args.fmt == "nvfp4" else 1.0
        copies = max(2, math.ceil(ROTATE_BYTES / (n * k * per_weight)))
        packs = {}
        for name, (p_nvfp4, p_fp8) in packers.items():
            if args.fmt == "nvfp4":
                packs[name] = [p_nvfp4(q.data.clone(), q.scale.clone(), q.global_scale) for _ in range(copies)]
            else:
                packs[name] = [p_fp8(q.data.clone(), q.scale.clone()) for _ in range(copies)]
        runs = {name: getattr(wo, f"weight_only_{args.fmt}") for name, wo in impls.items()}
        bf16 = [w.clone() for _ in range(max(1, math.ceil(ROTATE_BYTES / (n * k * 2))))]
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ya, yb = runs["A"](x, packs["A"][0]).float(), runs["B"](x, packs["B"][0]).float()
            if args.match == "bits":
                torch.testing.assert_close(ya, yb, rtol=0, atol=0)
            else:  # each within 2^-8 relative (+ FP32 summation) of the exact product
                torch.testing.assert_close(ya, yb, rtol=2.0 ** -7, atol=2e-4 * ya.abs().max().item())
            t_bf16 = bench_graph_ms(lambda x=x, ws=bf16: [x @ b.t() for b in ws]) * 1e3 / len(bf16)
            for sp in splits:
                times = {"A": [], "B": []}
                for _ in range(args.rounds):
                    for name, wo in impls.items():
                        wo.choose_split = choose[name] if sp is None else (lambda *a, sp=sp: sp)
                        times[name].append(bench_graph_ms(
                            lambda x=x, run=runs[name], ps=packs[name]: [run(x, pk) for pk in ps]) * 1e3 / copies)
                a, b = sorted(times["A"])[len(times["A"]) // 2], sorted(times["B"])[len(times["B"]) // 2]
                if sp is None:
                    ratios["A"].append(t_bf16 / a)
                    ratios["B"].append(t_bf16 / b)
                print(f"{n}x{k} M={m} splits {sp or 'auto'}: bf16 {t_bf16:6.2f} us | A {a:6.2f} | B {b:6.2f} us"
                      f" | B/A speedup {a / b:5.3f}", flush=True)
    for name, r in ratios.items():
        if r:
            print(f"{name}: geomean x bf16 {math.exp(sum(map(math.log, r)) / len(r)):.3f}")


if __name__ == "__main__":
    main()
