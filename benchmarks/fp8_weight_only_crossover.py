"""Where ``FP8InferenceLinear`` should stop leaving ``x`` in bf16: its two paths on the Llama-3-8B
projections, per M, as ``bench decode`` times them (CUDA graph of back-to-back calls, layers
cycled past L2): the weight-only kernel (``weight_only_max_m`` above M) against W8A8 (0: ``x``
quantized per call, then the FP8 GEMM), and bf16 ``nn.Linear``.

    python benchmarks/fp8_weight_only_crossover.py [--ms 16,32,48,64]
"""

from __future__ import annotations

import argparse

import torch

from lowprec.bench.common import bench_graph_ms
from lowprec.bench.decode import SHAPES, rotation_copies
from lowprec.nn import FP8InferenceLinear


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="16,32,48,64", help="at most 64: the FP8 kernel's widest token tile")
    args = p.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    for n, k in SHAPES:
        linears = [torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
                   for _ in range(rotation_copies(2.0 * n * k))]
        fp8 = [FP8InferenceLinear.from_linear(lin) for lin in linears[:rotation_copies(1.0 * n * k)]]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                t_bf16 = bench_graph_ms(lambda x=x, ls=linears: [lin(x) for lin in ls]) * 1e3 / len(linears)
                times = {}
                for name, max_m in (("weight-only", max(ms)), ("W8A8", 0)):
                    for layer in fp8:
                        layer.weight_only_max_m = max_m
                        layer(x)  # the packed copy is made by an eager call, outside the graph
                    times[name] = bench_graph_ms(lambda x=x, ls=fp8: [layer(x) for layer in ls]) * 1e3 / len(fp8)
            print(f"{n}x{k} M={m:3d}: bf16 {t_bf16:6.1f} us | weight-only {times['weight-only']:6.1f} "
                  f"({t_bf16 / times['weight-only']:4.2f}x) | W8A8 {times['W8A8']:6.1f} "
                  f"({t_bf16 / times['W8A8']:4.2f}x)", flush=True)


if __name__ == "__main__":
    main()
