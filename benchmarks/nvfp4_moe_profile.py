"""Where an NVFP4InferenceMoE decode step's GPU time goes: torch.profiler over eager steps, each
kernel's mean GPU µs per step, the grouped weight-only GEMMs against their weight bytes.

    python benchmarks/nvfp4_moe_profile.py [--config E,H,F,k] [--tokens 1] [--steps 20] [--by-op]

``--by-op``: also one step's kernels in launch order, each under the op that launched it.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from lowprec.moe import MoE, NVFP4InferenceMoE


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="64,7168,2048,8")
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--by-op", action="store_true")
    args = p.parse_args()
    experts, hidden, ffn, top_k = (int(v) for v in args.config.split(","))
    torch.manual_seed(0)
    moe = MoE(hidden, ffn, experts, top_k, device="cuda", dtype=torch.bfloat16)
    layer = NVFP4InferenceMoE.from_moe(moe)
    x = torch.randn(args.tokens, hidden, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            layer(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                layer(x)
            torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name[:90]] += ev.device_time / args.steps
    total = sum(per_kernel.values())
    busy = min(experts, args.tokens * top_k)
    weight_mb = busy * 3 * hidden * ffn * 0.5625 / 1e6
    print(f"E{experts} H{hidden} F{ffn} k{top_k} T{args.tokens}: {len(per_kernel)} kernels, {total:.1f} us GPU per "
          f"step; weights of the {busy} busy experts {weight_mb:.1f} MB")
    for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
        print(f"{us:8.1f} us  {name}")
    if args.by_op:
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                      record_shapes=True) as prof:
            layer(x)
            torch.cuda.synchronize()
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CPU and ev.kernels:
                for k in ev.kernels:
                    print(f"{k.duration:6.1f} us  {ev.name[:40]:40s} {str(ev.input_shapes)[:60]:60s} {k.name[:60]}")


if __name__ == "__main__":
    main()
