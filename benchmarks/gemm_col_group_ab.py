"""Same-run A/B of the weight-gradient GEMM's B-scale kinds at the Llama-3-8B-shaped training
step's weight gradients (out x in x 8192 tokens): 1x128 B scales (one per column, the
``fp8_block`` recipe), 16x128 blocks (one per 16 columns, ``fp8_block_wgrad16``) and 128x128
blocks (``fp8_block_wgrad2d``), each at the tile the heuristic picks (plus any ``--col16-configs``).
The 16x128 kind's output is asserted bit-identical to the per-column kind's fed the same scale
repeated per column. TFLOPS in rot timing (a CUDA graph of back-to-back calls over input sets
past L2), rounds interleaved with alternating order, median.

    python benchmarks/gemm_col_group_ab.py [--col16-configs 256x128_c1x2_n8] [--rounds 4] [--rep 200]
"""
import argparse

import torch

from lowprec.bench.gemm import interleaved_tflops_row, rot_set_count
from lowprec.gemm.sm90.interface import gemm_blockwise_fp8
from lowprec.gemm.sm90.tune import parse_config

SHAPES = [(4096, 4096, 8192), (28672, 4096, 8192), (4096, 14336, 8192), (14336, 4096, 8192)]


def operands(m, n, k, gen):
    """A (1x128 scales) and B's codes with its scales in the three kinds."""
    kb = -(-k // 128)
    a = (torch.randn(m, k, device="cuda", generator=gen) * 50).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device="cuda", generator=gen) * 50).to(torch.float8_e4m3fn)
    sa = (torch.rand(m, kb, device="cuda", generator=gen) + 0.5).t().contiguous().t()
    sb16 = torch.rand(-(-n // 16), kb, device="cuda", generator=gen) + 0.5
    sb128 = torch.rand(-(-n // 128), kb, device="cuda", generator=gen) + 0.5
    return a, sa, b, {"col": sb16.repeat_interleave(16, 0)[:n].contiguous(), "col16": sb16, "block": sb128}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--col16-configs", default="")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--rep", type=int, default=200)
    args = p.parse_args()
    extra = [c for c in args.col16_configs.split(",") if c]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m, n, k in SHAPES:
        sets = [operands(m, n, k, gen) for _ in range(rot_set_count(m, n, k))]
        variants = {"col": ("col", 1, None), "col16": ("col16", 16, None), "block": ("block", 128, None)}
        variants.update({f"col16@{c}": ("col16", 16, parse_config(c)) for c in extra})

        def call(s, kind, block_n, cfg):
            a, sa, b, sbs = s
            return gemm_blockwise_fp8(a, sa, b, sbs[kind], config=cfg, b_block_n=block_n)

        outs = {nm: call(sets[0], *v) for nm, v in variants.items()}
        for nm in variants:
            if variants[nm][0] == "col16":
                assert torch.equal(outs[nm], outs["col"]), f"{m}x{n}x{k}: {nm} bits differ from col"
        calls = {nm: lambda s, v=v: call(s, *v) for nm, v in variants.items()}
        row = interleaved_tflops_row(calls, sets, 2 * m * n * k, args.rep, args.rounds)
        print(f"{m}x{n}x{k}: {row}", flush=True)


if __name__ == "__main__":
    main()
