"""``python -m lowprec bench linear``: FP8Linear (fp8_block) vs nn.Linear in bf16, forward and
forward+backward, 16384 tokens. Inputs and weights bf16, random; L2 flushed between runs.

Two timings of forward+backward: synced (the host waits for the GPU before each run, so the
FP8 path's Python launch time before its first kernel counts) and queued (no sync between runs,
as a training step of many layers: host time only counts where it exceeds GPU time); queued
also with the weight quantized once (:func:`lowprec.nn.reuse_quantized_weights`: the micro-batches
after the first in gradient accumulation)."""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from ..nn import FP8Linear, reuse_quantized_weights
from .common import bench_ms, print_table, save_results

TOKENS = 16384
SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192)]


def _fwd(layer, x):
    return lambda: layer(x)


def _fwd_bwd(layer, x, dy):
    def run():
        x.grad = None
        layer.weight.grad = None
        layer(x).backward(dy)
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowprec bench linear", description=__doc__)
    parser.add_argument("--recipe", default="fp8_block")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench linear needs a CUDA GPU")
    rows, records = [], []
    for k, n in SHAPES:
        ref = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        fp8 = FP8Linear.from_linear(copy.deepcopy(ref), args.recipe)
        x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(TOKENS, n, device="cuda", dtype=torch.bfloat16)
        flops = 2 * TOKENS * k * n
        t = {name: (bench_ms(_fwd(layer, x)), bench_ms(_fwd_bwd(layer, x, dy)),
                    bench_ms(_fwd_bwd(layer, x, dy), queued=True))
             for name, layer in (("bf16", ref), ("fp8", fp8))}
        with reuse_quantized_weights():
            fp8_reused = bench_ms(_fwd_bwd(fp8, x, dy), queued=True)
        row = {"shape": [TOKENS, k, n], "bf16_fwd_ms": t["bf16"][0], "fp8_fwd_ms": t["fp8"][0],
               "bf16_fwd_bwd_ms": t["bf16"][1], "fp8_fwd_bwd_ms": t["fp8"][1],
               "bf16_fwd_bwd_queued_ms": t["bf16"][2], "fp8_fwd_bwd_queued_ms": t["fp8"][2],
               "fp8_fwd_bwd_queued_reused_weight_ms": fp8_reused,
               "speedup_fwd": t["bf16"][0] / t["fp8"][0], "speedup_fwd_bwd": t["bf16"][1] / t["fp8"][1],
               "speedup_fwd_bwd_queued": t["bf16"][2] / t["fp8"][2],
               "speedup_fwd_bwd_queued_reused_weight": t["bf16"][2] / fp8_reused,
               "fp8_fwd_tflops": flops / t["fp8"][0] / 1e9, "fp8_fwd_bwd_tflops": 3 * flops / t["fp8"][1] / 1e9}
        records.append(row)
        rows.append([f"{TOKENS}x{k}->{n}", t["bf16"][0], t["fp8"][0], row["speedup_fwd"], t["bf16"][1], t["fp8"][1],
                     row["speedup_fwd_bwd"], row["speedup_fwd_bwd_queued"],
                     row["speedup_fwd_bwd_queued_reused_weight"]])
    print_table(["shape", "bf16 fwd ms", "fp8 fwd ms", "x fwd", "bf16 f+b ms", "fp8 f+b ms", "x f+b",
                 "x f+b queued", "x f+b queued, W reused"], rows)
    path = save_results("linear", {"device": torch.cuda.get_device_name(), "recipe": args.recipe, "rows": records},
                        args.out)
    print(f"saved {path}")
    return 0
