"""Same-run A/B of dense GEMM tile configs at the Llama-3-8B-shaped training step's GEMMs (8192
tokens): outputs asserted bit-identical across the configs, then TFLOPS in rot timing (a CUDA graph
of back-to-back calls over input sets past L2), rounds interleaved with alternating order (gemm
NOTES, session 8), median.

    python benchmarks/gemm_config_ab.py --kind col --configs 256x112_c1x2_n8,256x96_c1x2_n8_wov
        [--rounds 4] [--rep 200] [--out-dtype bfloat16]
"""
import argparse

import torch

from lowprec.bench.gemm import interleaved_tflops_row, rot_set_count
from lowprec.gemm.sm90.interface import gemm_blockwise_fp8
from lowprec.gemm.sm90.tune import parse_config, random_operands

# weight gradients (1x128 B scales: out x in x tokens) and forward / input gradients (128x128 B
# scales: tokens x out x in) of the q / o, fused gate-up and down projections
SHAPES = {"col": [(4096, 4096, 8192), (28672, 4096, 8192), (4096, 14336, 8192), (14336, 4096, 8192)],
          "block": [(8192, 4096, 4096), (8192, 28672, 4096), (8192, 4096, 14336)]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kind", choices=list(SHAPES), default="col")
    p.add_argument("--configs", required=True)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--rep", type=int, default=200)
    p.add_argument("--out-dtype", default="bfloat16")
    args = p.parse_args()
    out_dtype = getattr(torch, args.out_dtype)
    names = args.configs.split(",")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m, n, k in SHAPES[args.kind]:
        sets = [random_operands(m, n, k, args.kind == "col", gen) for _ in range(rot_set_count(m, n, k))]
        cfgs = {nm: parse_config(nm) for nm in names}
        outs = {nm: gemm_blockwise_fp8(*sets[0], out_dtype=out_dtype, config=c) for nm, c in cfgs.items()}
        for nm in names[1:]:
            assert torch.equal(outs[names[0]], outs[nm]), f"{m}x{n}x{k}: {nm} bits differ from {names[0]}"
        calls = {nm: lambda s, c=c: gemm_blockwise_fp8(*s, out_dtype=out_dtype, config=c) for nm, c in cfgs.items()}
        row = interleaved_tflops_row(calls, sets, 2 * m * n * k, args.rep, args.rounds)
        print(f"{args.kind} {m}x{n}x{k} {args.out_dtype}: {row}", flush=True)


if __name__ == "__main__":
    main()
