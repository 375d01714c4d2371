"""The NVFP4 MoE layer at prefill sizes against the bf16 MoE (``torch._grouped_mm``): the shipped
rule (from ``DEQUANT_MIN_M`` rows per expert on average, each expert's weight decoded to bf16 for a
cuBLAS GEMM) and the grouped weight-only kernel at every size. Router included, no grad; CUDA
events around one call, host synced before each, L2 flushed; ms and x bf16.

    python benchmarks/nvfp4_moe_prefill.py [--configs E,H,F,k;...] [--tokens 1024,4096,16384]
"""

from __future__ import annotations

import argparse
import functools

import torch

from lowprec.bench.common import bench_ms
from lowprec.bench.moe import bf16_layer
from lowprec.gemm.sm90 import weight_only_interface as wo
from lowprec.moe import MoE, NVFP4InferenceMoE


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="8,4096,14336,2;64,7168,2048,8;128,2048,768,8",
                   help="experts, hidden, ffn, top-k; semicolon-separated")
    p.add_argument("--tokens", default="1024,4096,16384")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}: ms per MoE layer call (x bf16)")
    for text in args.configs.split(";"):
        run_config(*(int(v) for v in text.split(",")), [int(t) for t in args.tokens.split(",")])
        torch.cuda.empty_cache()


def run_config(experts: int, hidden: int, ffn: int, top_k: int, token_counts: list[int]):
    rule = wo.DEQUANT_MIN_M
    moe = MoE(hidden, ffn, experts, top_k, device="cuda", dtype=torch.bfloat16)
    nvfp4 = NVFP4InferenceMoE.from_moe(moe)
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        calls = (("bf16", functools.partial(bf16_layer, x, moe.router.weight, top_k, moe.w1, moe.w2), rule),
                 ("nvfp4", functools.partial(nvfp4, x), rule),
                 ("nvfp4 kernel", functools.partial(nvfp4, x), 1 << 62))
        times = {}
        with torch.no_grad():
            for name, fn, least in calls:
                wo.DEQUANT_MIN_M = least
                times[name] = bench_ms(fn, warmup=3, rep=10)
            wo.DEQUANT_MIN_M = rule
        print(f"E{experts} H{hidden} F{ffn} k{top_k} T{tokens} ({tokens * top_k / experts:.0f} rows per expert): "
              f"bf16 {times['bf16']:7.3f} | NVFP4 {times['nvfp4']:7.3f} ({times['bf16'] / times['nvfp4']:4.2f}x) | "
              f"NVFP4, grouped kernel {times['nvfp4 kernel']:7.3f} ({times['bf16'] / times['nvfp4 kernel']:4.2f}x)",
              flush=True)


if __name__ == "__main__":
    main()
