"""Host time per eager call of lowprec.gemm (and the quantize + gemm of an FP8 linear forward) on a
small problem (GPU always ahead of the host, so wall time per call = host time), next to
torch._scaled_mm blockwise; then a cProfile of the lowprec calls.
    python benchmarks/gemm_host_time.py [M N K]"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

import lowprec
from lowprec.bench.common import back_to_back_us
from lowprec.bench.gemm import _cublas_blockwise_fn, _probe_cublas


def main():
    m, n, k = (int(x) for x in sys.argv[1:4]) if len(sys.argv) > 3 else (64, 2112, 7168)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a = lowprec.quantize(x, "fp8_block1x128")
    b = lowprec.quantize(w, "fp8_block128x128")
    ok, err, note = _probe_cublas()
    print(f"# cuBLAS blockwise: {note} (err {err:.2g})")
    cublas = _cublas_blockwise_fn(a.data, a.scale, b.data, b.scale)
    calls = {
        "lowprec.gemm": lambda: lowprec.gemm(a, b),
        "quantize 1x128": lambda: lowprec.quantize(x, "fp8_block1x128", check_finite=False),
        "quantize + gemm": lambda: lowprec.gemm(lowprec.quantize(x, "fp8_block1x128", check_finite=False), b),
        "torch._scaled_mm blockwise": cublas,
        "torch.matmul bf16": lambda: x @ w.t(),
    }
    for _ in range(2):  # twice: the host's speed drifts; compare rows of one round
        for name, fn in calls.items():
            print(f"{name:28s} {back_to_back_us(fn, calls=500, reps=1):8.1f} us/call")
    for name in ("lowprec.gemm", "quantize + gemm"):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            calls[name]()
        torch.cuda.synchronize()
        prof.disable()
        print(f"\n===== cProfile: {name} (300 calls)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
