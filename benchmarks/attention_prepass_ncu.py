"""The K / V pre-pass kernels of one shape, for Nsight Compute (three calls each; profile the last):
    ncu --kernel-name regex:quant --launch-skip 4 --launch-count 2 --metrics ... \\
        python benchmarks/attention_prepass_ncu.py B HKV S D [--target-ctas N]
``--target-ctas``: the launch size the cluster rule aims at (``config.PREPASS_TARGET_CTAS``)."""

from __future__ import annotations

import sys

import torch

from lowprec.attention.quantize import quantize_k, quantize_v
from lowprec.attention.sm90 import config


def main():
    B, Hkv, S, D = (int(x) for x in sys.argv[1:5])
    if "--target-ctas" in sys.argv:
        n = int(sys.argv[sys.argv.index("--target-ctas") + 1])
        config.PREPASS_TARGET_CTAS = (n, n // 2)
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    v = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    print("cluster", config.prepass_cluster(B * Hkv, S, D * 2))
    for _ in range(3):
        quantize_k(k)
        quantize_v(v)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
