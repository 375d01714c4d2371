"""Host-time profile of FP8Linear forward+backward on a small layer (GPU): cProfile of N steps,
the top functions by total and cumulative time. python benchmarks/host_profile_linear.py [N]"""

import cProfile
import pstats
import sys
import time

import torch
from torch import nn

import lowprec

n = int(sys.argv[1]) if len(sys.argv) > 1 else 50
layer = lowprec.convert(nn.Linear(512, 512, bias=False, device="cuda", dtype=torch.bfloat16))
x = torch.randn(8192, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(8192, 512, device="cuda", dtype=torch.bfloat16)


def step():
    layer(x).backward(dy)


for _ in range(5):
    step()
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(n):
    step()
host = (time.perf_counter() - t) / n
torch.cuda.synchronize()
synced = (time.perf_counter() - t) / n
print(f"host time per fwd+bwd: {host * 1e3:.3f} ms (queued); per step with the GPU: {synced * 1e3:.3f} ms")
t = time.perf_counter()
for _ in range(n):
    y = layer(x)
fwd = (time.perf_counter() - t) / n
torch.cuda.synchronize()
print(f"host time per forward: {fwd * 1e3:.3f} ms")
prof = cProfile.Profile()
prof.enable()
for _ in range(n):
    step()
torch.cuda.synchronize()
prof.disable()
stats = pstats.Stats(prof)
stats.sort_stats("tottime").print_stats(25)
stats.sort_stats("cumulative").print_stats(35)
