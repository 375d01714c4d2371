"""Profile target for Nsight Compute: the NVFP4 weight-only kernel at N x 4096 (N = 4096 unless
``--n``), M = 1, one split unless ``--splits`` (each CTA then walks all 32 K chunks: the per-chunk
serial time shows); ``--splits 0``: the shipped split choice.
    ncu --clock-control none --kernel-name regex:WeightOnly --launch-skip 2 --launch-count 1 \
        --set full -o $OUT/wo python benchmarks/weight_only_ncu.py [--splits 2] [--m 1] [--n 28672]
Runs the kernel three times (two warm-up launches, then the profiled one)."""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")
from lowprec import quantize  # noqa: E402
from lowprec.gemm.sm90 import weight_only_interface as wo  # noqa: E402
from lowprec.gemm.weight_only import pack_nvfp4  # noqa: E402
from lowprec.recipes import get_recipe  # noqa: E402


def main():
    splits = int(sys.argv[sys.argv.index("--splits") + 1]) if "--splits" in sys.argv else 1
    m = int(sys.argv[sys.argv.index("--m") + 1]) if "--m" in sys.argv else 1
    n = int(sys.argv[sys.argv.index("--n") + 1]) if "--n" in sys.argv else 4096
    w = torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16) * 4096 ** -0.5
    q = quantize(w, get_recipe("nvfp4"))
    packed = pack_nvfp4(q.data, q.scale, q.global_scale)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    if splits:
        wo.choose_split = lambda *args: splits
    torch.cuda.synchronize()
    for _ in range(3):
        wo.weight_only_nvfp4(x, packed)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
