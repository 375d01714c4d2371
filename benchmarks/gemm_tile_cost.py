"""A dense GEMM's time per tile split into a fixed part and a part per K block: one config of
lowprec's kernel (forced) against DeepGEMM on the same operands, over a sweep of K at fixed M, N.

For each K: rot timing as ``bench gemm`` (a CUDA graph of back-to-back calls cycling over input
sets past L2), rounds interleaved with alternating order, median; then µs per tile-wave (time /
(tiles / SMs)) and a least-squares line through them: ``fixed + per_block * K / 128``. Session 33
(H100, 4096x24576, 256x128 c1x2 n8): lowprec 2.09 µs + 0.856 per K block, DeepGEMM 1.30 + 0.880.
DeepGEMM is optional (how to get the version measured: ``benchmarks/grouped_vs_deepgemm.py``).

    PYTHONPATH=dg:$PYTHONPATH python benchmarks/gemm_tile_cost.py [--mn 4096,24576]
        [--config 256x128_c1x2_n8] [--ks 512,1024,1536,3072,6144] [--rounds 4]
"""
import argparse
import statistics

import torch

from lowprec.bench.gemm import _deepgemm, _interleaved_rounds, _rot_timer, blockwise_input_sets, deepgemm_call
from lowprec.gemm.sm90.interface import gemm_blockwise_fp8
from lowprec.gemm.sm90.tune import parse_config


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mn", default="4096,24576")
    p.add_argument("--config", default="256x128_c1x2_n8")
    p.add_argument("--ks", default="512,1024,1536,3072,6144")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    m, n = (int(x) for x in args.mn.split(","))
    cfg = parse_config(args.config)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    waves = -(-m // cfg.tile_m) * -(-n // cfg.tile_n) / sms
    gen = torch.Generator(device="cuda").manual_seed(0)
    points = {}
    for k in (int(x) for x in args.ks.split(",")):
        sets = blockwise_input_sets(m, n, k, gen)
        calls = {"lowprec": [(lambda s=s: gemm_blockwise_fp8(*s, config=cfg)) for s in sets]}
        if _deepgemm() is not None:
            calls["deepgemm"] = [deepgemm_call(*s) for s in sets]
        for fns in calls.values():
            fns[0]()
        rounds = _interleaved_rounds({nm: _rot_timer(fns) for nm, fns in calls.items()}, 200, rounds=args.rounds)
        for nm, ts in rounds.items():
            t = statistics.median(ts)
            points.setdefault(nm, []).append((k / 128, t * 1e3 / waves))
            print(f"K={k:6d} {nm:9s} {t * 1e3:8.1f} us {2 * m * n * k / t / 1e9:6.0f} TFLOPS"
                  f"  {t * 1e3 / waves:6.2f} us per tile-wave", flush=True)
    for nm, pts in points.items():
        mx = statistics.fmean(x for x, _ in pts)
        my = statistics.fmean(y for _, y in pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        print(f"{nm}: {my - slope * mx:.2f} us per tile + {slope:.3f} us per K block")


if __name__ == "__main__":
    main()
