"""``python -m lowprec bench linear``: FP8Linear (fp8_block) vs nn.Linear in bf16, forward and
forward+backward, 16384 tokens. Inputs and weights bf16, random; L2 flushed between runs.

Two timings of forward+backward: synced (the host waits for the GPU before each run, so the
FP8 path's Python launch time before its first kernel counts) and queued (no sync between runs,
as a training step of many layers: host time only counts where it exceeds GPU time); queued
also with the weight quantized once (:func:`lowprec.nn.reuse_quantized_weights`: the micro-batches
after the first in gradient accumulation).

A second table splits the FP8 forward+backward into its kernels, each timed alone (queued, so GPU
time): the two dual quantizations (X, dY), the weight's 128x128 quantization with its transposed
copy, and the three GEMMs (fprop X·Wᵀ, dgrad dY·W, wgrad dYᵀ·X with 1x128 scales on both sides);
their sum against the measured step shows what running them back to back costs or saves."""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from ..gemm import gemm
from ..nn import FP8Linear, reuse_quantized_weights
from ..nn.functional import get_linear_recipe
from ..nn.weight_cache import quantize_weight
from ..quant import quantize_dual
from ..recipes import LINEAR_RECIPES
from .common import bench_ms, load_results, off_16, positive_int, print_table, save_results, shape_pairs

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


STEP_PARTS = ("quant x", "quant w", "fprop", "quant dy", "dgrad", "wgrad")
GEMM_PARTS = ("fprop", "dgrad", "wgrad")


def step_parts_ms(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, recipe: str = "fp8_block"
                  ) -> dict[str, float]:
    """GPU milliseconds (L2 flushed, median) of each kernel of one FP8 forward+backward of
    ``x · weightᵀ``, run alone, keyed by :data:`STEP_PARTS`."""
    r = get_linear_recipe(recipe)
    x, dy = x.detach(), dy.detach()
    x_q, xt_q = quantize_dual(x, r.activation, r.wgrad_activation)  # as FP8Linear's forward
    w_q, w_t = quantize_weight(weight.detach(), r.weight, with_transpose=True)
    dy_q, dyt_q = quantize_dual(dy, r.grad)
    calls = {
        "quant x": lambda: quantize_dual(x, r.activation, r.wgrad_activation),
        "quant w": lambda: quantize_weight(weight.detach(), r.weight, with_transpose=True),
        "fprop": lambda: gemm(x_q, w_q, out_dtype=x.dtype),
        "quant dy": lambda: quantize_dual(dy, r.grad),
        "dgrad": lambda: gemm(dy_q, w_t, out_dtype=dy.dtype),
        "wgrad": lambda: gemm(dyt_q, xt_q, out_dtype=weight.dtype),
    }
    return {name: bench_ms(calls[name], queued=True) for name in STEP_PARTS}


def save(payload: dict, path: str | None = None, sizes: bool = False) -> str:
    """Save ``payload`` as the ``linear`` section, or with ``sizes`` (a ``--shapes`` run) into
    ``linear_sizes``: such a run measures some layers, so the saved rows of the other layers (of
    the same recipe: the section names one) stay."""
    if not sizes:
        return save_results("linear", payload, path)
    saved = load_results("linear_sizes", path)
    same_recipe = saved is not None and saved.get("recipe") == payload["recipe"]
    return save_results("linear_sizes", payload, path, merge_rows_by="shape" if same_recipe else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowprec bench linear", description=__doc__)
    # checked here: an unknown name would otherwise fail only after the GPU set-up, as a traceback
    parser.add_argument("--recipe", default="fp8_block", choices=sorted(LINEAR_RECIPES))
    parser.add_argument("--tokens", type=positive_int, default=TOKENS, help=f"rows of x (default {TOKENS})")
    parser.add_argument("--shapes", type=shape_pairs, default=None,
                        help="layers as in_features x out_features, comma-separated (e.g. 1024x2816,2048x2048); "
                             "results then go under 'linear_sizes' (where convert's size threshold comes from)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    shapes = SHAPES if args.shapes is None else args.shapes
    if odd := off_16(shapes):  # else FP8Linear raises after the GPU set-up
        parser.error(f"--shapes: FP8Linear needs in_features and out_features in multiples of 16, got {odd}")
    tokens = args.tokens
    if not torch.cuda.is_available():
        raise SystemExit("bench linear needs a CUDA GPU")
    rows, records, part_rows = [], [], []
    for k, n in shapes:
        ref = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        fp8 = FP8Linear.from_linear(copy.deepcopy(ref), args.recipe)
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        flops = 2 * tokens * k * n
        t = {name: (bench_ms(_fwd(layer, x)), bench_ms(_fwd_bwd(layer, x, dy)),
                    bench_ms(_fwd_bwd(layer, x, dy), queued=True))
             for name, layer in (("bf16", ref), ("fp8", fp8))}
        with reuse_quantized_weights():
            fp8_reused = bench_ms(_fwd_bwd(fp8, x, dy), queued=True)
        parts = step_parts_ms(x, fp8.weight, dy, args.recipe)
        row = {"shape": [tokens, k, n], "bf16_fwd_ms": t["bf16"][0], "fp8_fwd_ms": t["fp8"][0],
               "bf16_fwd_bwd_ms": t["bf16"][1], "fp8_fwd_bwd_ms": t["fp8"][1],
               "bf16_fwd_bwd_queued_ms": t["bf16"][2], "fp8_fwd_bwd_queued_ms": t["fp8"][2],
               "fp8_fwd_bwd_queued_reused_weight_ms": fp8_reused,
               "speedup_fwd": t["bf16"][0] / t["fp8"][0], "speedup_fwd_bwd": t["bf16"][1] / t["fp8"][1],
               "speedup_fwd_bwd_queued": t["bf16"][2] / t["fp8"][2],
               "speedup_fwd_bwd_queued_reused_weight": t["bf16"][2] / fp8_reused,
               "fp8_fwd_tflops": flops / t["fp8"][0] / 1e9, "fp8_fwd_bwd_tflops": 3 * flops / t["fp8"][1] / 1e9,
               "fp8_step_parts_ms": parts,
               "fp8_gemm_tflops": {g: flops / parts[g] / 1e9 for g in GEMM_PARTS}}
        records.append(row)
        part_rows.append([f"{tokens}x{k}->{n}", *(parts[p] for p in STEP_PARTS),
                          *(row["fp8_gemm_tflops"][g] for g in GEMM_PARTS), sum(parts.values()), t["fp8"][2]])
        rows.append([f"{tokens}x{k}->{n}", t["bf16"][0], t["fp8"][0], row["speedup_fwd"], t["bf16"][1], t["fp8"][1],
                     row["speedup_fwd_bwd"], row["speedup_fwd_bwd_queued"],
                     row["speedup_fwd_bwd_queued_reused_weight"]])
    print_table(["shape", "bf16 fwd ms", "fp8 fwd ms", "x fwd", "bf16 f+b ms", "fp8 f+b ms", "x f+b",
                 "x f+b queued", "x f+b queued, W reused"], rows)
    print("\nFP8 forward+backward by kernel (each alone, GPU ms; GEMMs also in TFLOPS):")
    print_table(["shape", *(f"{p} ms" for p in STEP_PARTS), *(f"{g} TFLOPS" for g in GEMM_PARTS),
                 "sum ms", "f+b queued ms"], part_rows)
    payload = {"device": torch.cuda.get_device_name(), "recipe": args.recipe, "rows": records}
    path = save(payload, args.out, sizes=args.shapes is not None)
    print(f"saved {path}")
    return 0
