"""Host time of one K pre-pass launch by cluster size: back-to-back on tiny problems (the GPU is
always ahead, so µs per launch = host time), and one launch's wall time issued behind an 80 µs
flush (the GPU busy), as a lone eager call issues it.
    python benchmarks/attention_cluster_launch_host.py"""

from __future__ import annotations

import time

import torch

from lowprec.attention.sm90 import interface as ai
from lowprec.attention.sm90.config import prepass_cluster
from lowprec.bench.common import back_to_back_us


def main():
    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    for heads, s in ((2, 128), (2, 256), (2, 512), (2, 1024), (128, 4096), (512, 1024)):
        k = torch.randn(1, heads, s, 128, device=dev, dtype=torch.bfloat16)
        codes = torch.empty(heads * s * 128, dtype=torch.uint8, device=dev)
        sc = torch.empty(heads * s // 128, 1, device=dev)
        km = torch.empty(heads, 128, device=dev)
        part = torch.empty(ai.prepass_partials_numel(heads, 128), device=dev)

        def launch(k=k, codes=codes, sc=sc, km=km, part=part):
            ai._launch_prepass_k(k, codes, sc, km, part)

        us = back_to_back_us(launch, calls=200, reps=3) if heads * s <= 4096 else float("nan")
        walls = []
        for _ in range(20):
            torch.cuda.synchronize()
            flush.zero_()
            t0 = time.perf_counter()
            launch()
            walls.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        walls.sort()
        cluster = prepass_cluster(heads, s, 256)
        print(f"heads {heads:4d} S {s:5d} cluster {cluster:2d}: back-to-back {us:7.1f} us/launch, "
              f"one launch behind a flush {walls[len(walls) // 2]:7.1f} us (min {walls[0]:.1f})", flush=True)


if __name__ == "__main__":
    main()
