# ruff: noqa: B023  (scratch script: lambdas timed inside their own iteration)
"""Where the grouped NVFP4 GEMM should leave its one-launch kernel for the per-expert prefill path
(each expert on the dense path: from ``DEQUANT_MIN_M`` rows its weight decoded to bf16 and a
cuBLAS GEMM): both paths and bf16 ``torch._grouped_mm`` on the expert shapes of three MoE configs,
rows spread evenly over the experts. CUDA events around one call, host synced before each (the eager call's host time
counts: the per-expert path pays it per expert), L2 flushed; µs and x bf16.

    python benchmarks/nvfp4_grouped_prefill_crossover.py [--rows-per-expert 512,1024,2048,4096]
"""

from __future__ import annotations

import argparse

import torch

from lowprec.bench.common import bench_ms
from lowprec.gemm.sm90 import weight_only_interface as wo
from lowprec.gemm.weight_only import pack_nvfp4_experts
from lowprec.moe.nvfp4 import quantize_nvfp4_experts

# (experts, N, K): gate-up and down of E8 H4096 F14336, E64 H7168 F2048, E128 H2048 F768
SHAPES = [(8, 28672, 4096), (8, 4096, 14336), (64, 4096, 7168), (64, 7168, 2048), (128, 1536, 2048),
          (128, 2048, 768)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows-per-expert", default="512,1024,2048,4096")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}: µs per grouped call (x bf16 _grouped_mm)")
    for experts, n, k in SHAPES:
        w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        packed = pack_nvfp4_experts(*quantize_nvfp4_experts(w))
        for per in (int(r) for r in args.rows_per_expert.split(",")):
            rows = per * experts
            if rows * max(n, k) * 2 > 8 << 30:
                continue
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            ends = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * per
            times = {"bf16": 1e3 * bench_ms(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends), rep=20)}
            rule = wo.grouped_prefill
            for name, per_expert in (("kernel", False), ("per expert", True)):
                wo.grouped_prefill = lambda *shape: per_expert
                times[name] = 1e3 * bench_ms(lambda: wo.grouped_weight_only_nvfp4(x, packed, ends, False), rep=20)
            wo.grouped_prefill = rule
            work = per * n * k
            print(f"E{experts} {n}x{k} {per:5d} rows/expert (rows*N*K {work:.2e}): bf16 {times['bf16']:8.1f} "
                  f"| kernel {times['kernel']:8.1f} ({times['bf16'] / times['kernel']:4.2f}x) | per expert "
                  f"{times['per expert']:8.1f} ({times['bf16'] / times['per expert']:4.2f}x)", flush=True)


if __name__ == "__main__":
    main()
