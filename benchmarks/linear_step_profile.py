"""Where an FP8Linear training step's time goes (GPU): host time per step queued and synced,
then torch.profiler's table of CPU and CUDA time per op over 20 steps.
    python benchmarks/linear_step_profile.py [tokens in out]"""

import sys
import time

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import lowprec

t, i, o = (int(v) for v in sys.argv[1:4]) if len(sys.argv) > 3 else (8192, 1024, 2816)
for name, layer in (("nn.Linear", nn.Linear(i, o, bias=False, device="cuda", dtype=torch.bfloat16)),
                    ("FP8Linear", lowprec.convert(nn.Linear(i, o, bias=False, device="cuda", dtype=torch.bfloat16)))):
    x = torch.randn(t, i, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, o, device="cuda", dtype=torch.bfloat16)

    def step(layer=layer, x=x, dy=dy):
        layer(x).backward(dy)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    s = time.perf_counter()
    for _ in range(50):
        step()
    queued = (time.perf_counter() - s) / 50
    torch.cuda.synchronize()
    synced = (time.perf_counter() - s) / 50
    print(f"{name} [{t}x{i}] -> {o}: host {queued * 1e3:.3f} ms/step queued, {synced * 1e3:.3f} ms/step with the GPU")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
