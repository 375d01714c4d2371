# ruff: noqa: E501
"""The FP8 attention forward's fixed cost per tile against its cost per KV block (H100, kernel
only, Q codes given, Vᵀ permuted, CUDA-graph replay, do_bench median): non-causal B4 H32 Sq 4096
d128 over Sk = 128 .. 4096, so every run has the same tiles and only their KV blocks change. A
least-squares line through (blocks per SM, ms) gives the per-block cost and, at zero blocks, the
tiles' fixed cost (launch, Q and first K/V loads, pipeline fill and drain, epilogue).
    python benchmarks/attention_tile_cost.py [--persistent] [--d 128] [--clocks]
``--clocks``: also replays each Sk's call for ~2 s while ``nvidia-smi`` samples the SM clock and the
board power, and prints their medians (is the per-block cost at long Sk the clock's?)."""

from __future__ import annotations

import functools
import statistics
import subprocess
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
from lowprec.attention.sm90 import interface  # noqa: E402
from lowprec.attention.sm90.config import TILE_N, AttnConfig  # noqa: E402
from lowprec.attention.sm90.interface import fp8_attention_forward, permute_v_keys  # noqa: E402
from lowprec.bench.common import cuda_graph_replay  # noqa: E402
from tests.attention.test_sm90 import quantize_inputs  # noqa: E402


def sustained_clock(replay, seconds: float = 2.0) -> str:
    """Median SM clock (MHz) and board power (W) sampled while ``replay`` runs back to back."""
    sampler = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                "-lms", "50"], stdout=subprocess.PIPE, text=True)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(20):
            replay()
        torch.cuda.synchronize()
    sampler.terminate()
    rows = [line.split(",") for line in sampler.communicate()[0].strip().splitlines()[4:]]
    mhz = statistics.median(float(r[0]) for r in rows)
    watts = statistics.median(float(r[1]) for r in rows)
    return f", sustained {mhz:.0f} MHz {watts:.0f} W"


def main():
    d = int(sys.argv[sys.argv.index("--d") + 1]) if "--d" in sys.argv else 128
    interface.PERSISTENT = "--persistent" in sys.argv  # the grid unless asked (the default walks at d128)
    B, H, Sq = 4, 32, 4096
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = B * H * -(-Sq // AttnConfig(head_dim=d, consumer_wgs=interface.CONSUMER_WGS).tile_m)
    points = []
    for sk in (128, 256, 512, 1024, 2048, 4096):
        q = torch.randn(B, H, Sq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, H, sk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, H, sk, d, device="cuda", dtype=torch.bfloat16)
        qc, qs, kc, ks, vt, vs = quantize_inputs(q, k, v)
        out = torch.empty_like(q)
        fn = functools.partial(fp8_attention_forward, qc, qs, kc, ks, permute_v_keys(vt), vs, causal=False,
                               softmax_scale=d ** -0.5, out_dtype=torch.bfloat16, out=out, v_keys_permuted=True)
        fn()
        t = do_bench(cuda_graph_replay(fn), warmup=50, rep=300, return_mode="median")
        blocks_per_sm = tiles * (sk // TILE_N) / sms
        points.append((blocks_per_sm, t))
        clocks = sustained_clock(cuda_graph_replay(fn)) if "--clocks" in sys.argv else ""
        print(f"d{d} Sk {sk:5d}: {t:.4f} ms, {blocks_per_sm:.1f} KV blocks per SM, "
              f"{4 * B * H * Sq * sk * d / t / 1e9:.0f} TFLOPS{clocks}", flush=True)
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    icpt = my - slope * mx
    print(f"fit: {slope * 1e3:.3f} us per KV block per SM, {icpt * 1e3:.1f} us fixed = "
          f"{icpt * 1e3 / (tiles / sms):.2f} us per tile ({tiles / sms:.1f} tiles per SM); "
          f"persistent={interface.PERSISTENT}", flush=True)


if __name__ == "__main__":
    main()
