"""Where NVFP4 weights should stop taking the weight-only kernel: its two paths per M on the
Llama-3-8B projections and LM head, against bf16 ``F.linear`` in the same run. The weight-only
kernel, and the prefill path (the weight decoded to bf16 once, then cuBLAS with the global scale
as alpha), each forced; CUDA events around each call, queued (a prefill's many layers keep the
GPU fed), L2 flushed before each. Also the decode kernel alone, in GB/s of packed + bf16 bytes.

    python benchmarks/nvfp4_prefill_crossover.py [--ms 256,512,1024,2048,4096] [--shapes 6144x4096,...]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from lowprec import quantize
from lowprec.bench.common import bench_ms
from lowprec.bench.decode import SHAPES
from lowprec.gemm.sm90 import weight_only_interface as wo
from lowprec.gemm.weight_only import pack_nvfp4
from lowprec.recipes import get_recipe


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="256,512,1024,2048,4096")
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES + ((128256, 4096),)),
                   help="N x K, comma-separated (default: the four projections and the LM head)")
    args = p.parse_args()
    for n, k in [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]:
        _shape(n, k, [int(v) for v in args.ms.split(",")])


def _shape(n: int, k: int, ms: list[int]) -> None:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    q = quantize(w, get_recipe("nvfp4"))
    packed = pack_nvfp4(q.data, q.scale, q.global_scale)
    out = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
    words = packed.data.view(torch.int32).view(-1)
    dequant = wo.compile_dequant_kernel()
    t_dq = bench_ms(lambda: dequant(words, out.view(torch.int32), 0, packed.k_chunks), queued=True)
    gbs = (packed.data.numel() + 2 * n * k) / t_dq / 1e6
    print(f"{n}x{k}: decode to bf16 {t_dq * 1e3:7.1f} us ({gbs:5.0f} GB/s)", flush=True)
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        t_bf16 = bench_ms(lambda x=x: F.linear(x, w), queued=True)
        times = {}
        for name, least in (("kernel", 1 << 62), ("prefill", 1)):
            wo.DEQUANT_MIN_M = least
            times[name] = bench_ms(lambda x=x: wo.weight_only_nvfp4(x, packed), queued=True)
        print(f"{n}x{k} M={m:5d}: bf16 {t_bf16 * 1e3:8.1f} us | kernel {times['kernel'] * 1e3:8.1f} "
              f"({t_bf16 / times['kernel']:4.2f}x) | prefill path {times['prefill'] * 1e3:8.1f} "
              f"({t_bf16 / times['prefill']:4.2f}x)", flush=True)

if __name__ == "__main__":
    main()
