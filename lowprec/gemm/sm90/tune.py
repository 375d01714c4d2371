"""Time several tile configs of the sm_90a block-scaled GEMM per shape (CUDA-graph replay, L2
flushed by do_bench) to build / check the heuristic in ``interface.choose_config``.

    python -m lowprec.gemm.sm90.tune "4096,7168,7168;64,2112,7168" [--configs all|near]
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None):
    import triton.testing

    from ...bench.common import cuda_graph_replay
    from .interface import _shipped_configs, choose_config, gemm_blockwise_fp8

    p = argparse.ArgumentParser()
    p.add_argument("shapes")
    p.add_argument("--per-col", action="store_true")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--rep", type=int, default=30)
    p.add_argument("--tile-n", type=str, default=None, help="comma list of tile_n to try")
    args = p.parse_args(argv)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    for s in args.shapes.split(";"):
        m, n, k = (int(v) for v in s.split(","))
        kb, nb = -(-k // 128), -(-n // 128)
        a = (torch.randn(m, k, device="cuda", generator=gen) * 50).to(torch.float8_e4m3fn)
        b = (torch.randn(n, k, device="cuda", generator=gen) * 50).to(torch.float8_e4m3fn)
        sa = (torch.rand(m, kb, device="cuda", generator=gen) + 0.5).t().contiguous().t()
        sb = torch.rand(n if args.per_col else nb, kb, device="cuda", generator=gen) + 0.5
        chosen = choose_config(m, n, k, args.per_col)
        res = []
        for cfg in _shipped_configs():
            if args.per_col and cfg.tile_n > 128:
                continue
            if m <= 64 and cfg.tile_m == 128:
                continue
            if m >= 1024 and cfg.tile_m == 64:
                continue
            if args.tile_n and cfg.tile_n not in [int(v) for v in args.tile_n.split(",")]:
                continue
            def fn(a=a, sa=sa, b=b, sb=sb, cfg=cfg):
                return gemm_blockwise_fp8(a, sa, b, sb, config=cfg)

            try:
                t = triton.testing.do_bench(cuda_graph_replay(fn), warmup=5, rep=args.rep, return_mode="median")
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
