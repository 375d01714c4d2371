"""Time several tile configs of the sm_90a block-scaled GEMM per shape (CUDA-graph replay, L2
flushed by do_bench) to build / check the heuristic in ``interface.choose_config``.

    python -m lowprec.gemm.sm90.tune "4096,7168,7168;64,2112,7168" [--tile-n 128,176]
    python -m lowprec.gemm.sm90.tune "4096,7168,16384" --configs 128x128_c2x1_m1,128x128_c1x2_n4
"""

from __future__ import annotations

import argparse
import re
import sys

import torch


def parse_config(name: str):
    """TileConfig from its ``str`` form, e.g. ``128x128_c2x1_n4``, ``64x64_c1x1_m1_s2`` or
    ``64x64_c1x1_m1_nopdl`` (``_noov``: no wgmma / promotion overlap)."""
    from .config import TileConfig

    m = re.fullmatch(r"(\d+)x(\d+)_c(\d+)x(\d+)_([mn])(\d+)(?:_s(\d+))?(_nopdl)?(_noov)?", name)
    if m is None:
        raise ValueError(f"config {name!r}: expected e.g. 128x128_c2x1_m1 or 64x64_c1x1_m1_s2")
    bm, bn, cm, cn, raster, swz, sk, nopdl, noov = m.groups()
    return TileConfig(tile_m=int(bm), tile_n=int(bn), cluster_m=int(cm), cluster_n=int(cn),
                      raster_along_m=raster == "m", swizzle=int(swz), split_k=int(sk or 1),
                      pdl=nopdl is None, mma_overlap=noov is None)


def random_operands(m: int, n: int, k: int, per_col: bool, gen):
    """One random problem ``(a, sa, b, sb)`` for ``gemm_blockwise_fp8``: E4M3 A [M, K] and B [N, K],
    A's 1x128 scales MN-major, B's 1x128 (``per_col``) or 128x128 scales; scales in [0.5, 1.5)."""
    kb, nb = -(-k // 128), -(-n // 128)
    a = (torch.randn(m, k, device="cuda", generator=gen) * 50).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device="cuda", generator=gen) * 50).to(torch.float8_e4m3fn)
    sa = (torch.rand(m, kb, device="cuda", generator=gen) + 0.5).t().contiguous().t()
    sb = torch.rand(n if per_col else nb, kb, device="cuda", generator=gen) + 0.5
    return a, sa, b, sb


def main(argv=None):
    import triton.testing

    from ...bench.common import cuda_graph_replay
    from ...bench.gemm import _time_rot, rot_set_count
    from .interface import _shipped_configs, choose_config, gemm_blockwise_fp8

    p = argparse.ArgumentParser()
    p.add_argument("shapes")
    p.add_argument("--per-col", action="store_true")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--rep", type=int, default=30)
    p.add_argument("--tile-n", type=str, default=None, help="comma list of tile_n to try")
    p.add_argument("--rot", action="store_true",
                   help="time like `bench gemm` (graph of back-to-back calls over input sets > L2) "
                        "instead of single replays after an L2 flush (whose dirty lines distort small M)")
    p.add_argument("--configs", type=str, default=None,
                   help="comma list of configs to time instead of the shipped ones (shipped or not)")
    args = p.parse_args(argv)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    for s in args.shapes.split(";"):
        m, n, k = (int(v) for v in s.split(","))
        nsets = rot_set_count(m, n, k) if args.rot else 1
        sets = [random_operands(m, n, k, args.per_col, gen) for _ in range(nsets)]
        chosen = choose_config(m, n, k, 1 if args.per_col else 128)
        res = []
        cfgs = [parse_config(c) for c in args.configs.split(",")] if args.configs else _shipped_configs()
        for cfg in cfgs:
            if args.per_col and cfg.tile_n > 128:
                continue
            if m <= 64 and cfg.tile_m == 128:
                continue
            if m >= 1024 and cfg.tile_m == 64:
                continue
            if args.tile_n and cfg.tile_n not in [int(v) for v in args.tile_n.split(",")]:
                continue
            calls = [lambda s_=s_, cfg=cfg: gemm_blockwise_fp8(*s_, config=cfg) for s_ in sets]
            try:
                if args.rot:
                    t = _time_rot(calls, args.rep)
                else:
                    t = triton.testing.do_bench(cuda_graph_replay(calls[0]), warmup=5, rep=args.rep,
                                                return_mode="median")
            except Exception as e:  # noqa: BLE001
                print(f"  {cfg}: failed {type(e).__name__}: {str(e)[:100]}")
                continue
            res.append((t, cfg))
        res.sort(key=lambda x: x[0])
        flops = 2.0 * m * n * k

        def tf(t, flops=flops):
            return flops / (t * 1e-3) / 1e12

        t_ch = next((t for t, c in res if c == chosen), float("nan"))
        best = ", ".join(f"{c} {tf(t):.0f}" for t, c in res[: args.top])
        print(f"{m},{n},{k}: chosen {chosen} {tf(t_ch):.0f} TF | best: {best}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
