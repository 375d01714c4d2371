"""One launch each of lowprec's dense GEMM (the heuristic's pick or ``--config``) and DeepGEMM's
on the same operands, between ``cudaProfilerStart`` / ``Stop`` for Nsight Compute::

    PYTHONPATH=dg:$PYTHONPATH ncu --profile-from-start off --section SpeedOfLight \\
        --section WarpStateStats python benchmarks/dense_ncu.py 4096,7168,16384 [--config 256x128_c1x2_m1]
"""
import argparse

import torch

from lowprec.bench.gemm import _rand_fp8, _rand_scale, deepgemm_call
from lowprec.gemm.sm90.interface import gemm_blockwise_fp8
from lowprec.gemm.sm90.tune import parse_config


def main():
    p = argparse.ArgumentParser()
    p.add_argument("shape")
    p.add_argument("--config", default=None)
    args = p.parse_args()
    m, n, k = (int(v) for v in args.shape.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    a, b = _rand_fp8(m, k, gen), _rand_fp8(n, k, gen)
    sa, sb = _rand_scale(m, -(-k // 128), gen).t().contiguous().t(), _rand_scale(-(-n // 128), -(-k // 128), gen)
    cfg = parse_config(args.config) if args.config else None
    ours = lambda: gemm_blockwise_fp8(a, sa, b, sb, config=cfg)  # noqa: E731
    theirs = deepgemm_call(a, sa, b, sb)
    for _ in range(3):
        ours(), theirs()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    ours()
    theirs()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
