"""One launch of lowprec's dense GEMM per (kind, shape, config) given, between
``cudaProfilerStart`` / ``Stop`` for Nsight Compute: to compare the per-column (1x128 B scales:
weight gradients) and block (128x128 B scales) kinds' stall reasons and instruction mix::

    ncu --profile-from-start off --section WarpStateStats --section SchedulerStats \\
        python benchmarks/gemm_kind_ncu.py col:4096,14336,8192:256x112_c1x2_n8 block:8192,4096,14336:256x128_c1x2_n8
"""
import sys

import torch

from lowprec.gemm.sm90.interface import gemm_blockwise_fp8
from lowprec.gemm.sm90.tune import parse_config, random_operands


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    calls = []
    for spec in sys.argv[1:]:
        kind, shape, config = spec.split(":")
        m, n, k = (int(v) for v in shape.split(","))
        args = random_operands(m, n, k, kind == "col", gen)
        cfg = parse_config(config)
        calls.append(lambda args=args, cfg=cfg: gemm_blockwise_fp8(*args, config=cfg))
    for _ in range(3):
        for c in calls:
            c()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for c in calls:
        c()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
