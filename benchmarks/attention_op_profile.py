"""torch.profiler table of ``lowprec.attention(q, k, v, quant="fp8")`` at B4 H32 S4096 d128 (GPU
kernels of the pre-pass and the forward, per call), causal and not.
    python benchmarks/attention_op_profile.py"""

import torch
from torch.profiler import ProfilerActivity, profile

import lowprec

B, H, S, D = 4, 32, 4096, 128
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for causal in (False, True):
    for _ in range(3):
        lowprec.attention(q, k, v, causal=causal, quant="fp8")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        for _ in range(5):
            lowprec.attention(q, k, v, causal=causal, quant="fp8")
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
