"""Host time of an eager ``FP8InferenceLinear`` call at decode size (M = 1), and where it goes:
wall time per call of back-to-back calls, then cProfile of 300 calls (top functions by own time).

    python benchmarks/inference_linear_host_profile.py [N K]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch
from torch import nn

sys.path.insert(0, ".")
from lowprec.nn import FP8InferenceLinear  # noqa: E402


def main():
    n, k = (int(v) for v in sys.argv[1:3]) if len(sys.argv) > 2 else (1024, 1024)
    layer = FP8InferenceLinear.from_linear(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
    bf16 = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for name, fn in (("FP8InferenceLinear", layer), ("nn.Linear bf16", bf16)):
            for _ in range(50):
                fn(x)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(300):
                fn(x)
            torch.cuda.synchronize()
            print(f"{name}: {(time.perf_counter() - t) / 300 * 1e6:.1f} us per call (N={n} K={k}, M=1)")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            layer(x)
        prof.disable()
        torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
