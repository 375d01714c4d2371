"""Where a synced eager call's time goes between its kernels: the `bench attention` synced mode
(L2 flush, then the call, host waits), traced with torch.profiler; per call, each kernel's start
and end relative to the flush's end (µs), so host-bound gaps before and between launches show.
    python benchmarks/attention_call_gaps.py [d128|d128-causal|b16-s1k-causal|d64 ...]"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import lowprec

SHAPES = {"d128": (4, 32, 32, 4096, 128, False), "d128-causal": (4, 32, 32, 4096, 128, True),
          "b16-s1k-causal": (16, 32, 32, 1024, 128, True), "d64": (4, 32, 32, 4096, 64, False)}


def main(names):
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for name in names:
        b, h, hkv, s, d, causal = SHAPES[name]
        q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))

        def call(q=q, k=k, v=v, causal=causal):
            return lowprec.attention(q, k, v, causal=causal, quant="fp8")

        for _ in range(5):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                flush.zero_()
                call()
                torch.cuda.synchronize()
        kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: e.time_range.start)
        calls, cur = [], None
        for e in kernels:
            if "elementwise" in e.name or "fill" in e.name.lower() or "zero" in e.name.lower():
                cur = [e]
                calls.append(cur)
            elif cur is not None:
                cur.append(e)
        print(f"== {name}")
        for c in calls[1:]:
            t0 = c[0].time_range.end
            parts = [f"{e.name[:28]} {e.time_range.start - t0:.0f}..{e.time_range.end - t0:.0f}" for e in c[1:]]
            print("  flush " + f"{c[0].time_range.end - c[0].time_range.start:.0f} us | " + " | ".join(parts))


if __name__ == "__main__":
    main(sys.argv[1:] or list(SHAPES))
