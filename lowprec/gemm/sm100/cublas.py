"""cuBLASLt block-scaled GEMMs on Blackwell through ``torch._scaled_mm``: the fallback where
lowprec's sm_100a kernel does not take the operands (or failed its self-check), before the
reference. Never run here (no Blackwell GPU): registered behind the first-use self-check, so a
wrong call convention or scale layout is caught on its probe and the reference answers.

Formats: MXFP8 x MXFP8 (E8M0 per 32, scales in the 128x4 blocked layout), NVFP4 x NVFP4 (E4M3
per 16, blocked; the global scales multiply the FP32 result), and DeepSeek's ``fp8_block1x128`` x
``fp8_block128x128`` (FP32 scales, the activation grid outer-dim-major as cuBLAS reads it). PyTorch
(2.11-2.13) runs that last pair on SM90 only (``_check_deepseek_support`` raises
NotImplementedError elsewhere): on sm_100 its self-check fails, one warning names the error, and
the reference answers; the call is kept for a PyTorch that serves it.
"""

from __future__ import annotations

import torch

from ...quant.layouts import to_blocked

__all__ = ["PAIRS", "cublas_unsupported", "pair_of", "gemm_cublas", "probe"]

PAIRS = ("mxfp8 x mxfp8", "nvfp4 x nvfp4", "fp8_block1x128 x fp8_block128x128")
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def pair_of(a, b, out_dtype=None, bias=None) -> str:
    """The recipe pair of the operands (the self-check's configuration)."""
    return f"{a.recipe.name} x {b.recipe.name}"


def cublas_unsupported(a, b, out_dtype, bias) -> str | None:
    """Why cuBLASLt's block-scaled GEMM cannot take these operands (None: it can)."""
    pair = pair_of(a, b)
    if pair not in PAIRS:
        return f"recipes {pair} (cuBLASLt block-scaled takes {', '.join(PAIRS)})"
    if pair == "nvfp4 x nvfp4" and (tuple(a.recipe.block) != (1, 16) or tuple(b.recipe.block) != (1, 16)):
        return "NVFP4 16x16 scale blocks"
    if out_dtype not in _OUT_DTYPES:
        return f"out_dtype {out_dtype}"
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0 or k == 0 or k % 128 or n % 16:
        return f"M={m}, N={n}, K={k} (cuBLASLt block-scaled wants K a multiple of 128 and N of 16)"
    return None


def gemm_cublas(a, b, out_dtype, bias):
    """``dequant(a) · dequant(b)ᵀ (+ bias)`` by ``torch._scaled_mm`` (``cublas_unsupported`` holds)."""
    pair = pair_of(a, b)
    acc_dtype = out_dtype if bias is None else torch.float32  # the bias joins before the one rounding
    if pair == "mxfp8 x mxfp8":
        y = torch._scaled_mm(a.data, b.data.t(), to_blocked(a.scale), to_blocked(b.scale), out_dtype=acc_dtype)
    elif pair == "nvfp4 x nvfp4":
        fp4 = torch.float4_e2m1fn_x2
        y = torch._scaled_mm(a.data.view(fp4), b.data.view(fp4).t(), to_blocked(a.scale), to_blocked(b.scale),
                             out_dtype=torch.float32)
        y = (y * (a.global_scale * b.global_scale)).to(acc_dtype)
    else:
        sa = a.scale.t().contiguous().t()  # [M, K/128], outer-dim-major
        # scale_b is the grid of b.data.t(): [K/128, N/128] (torch's argument check)
        y = torch._scaled_mm(a.data, b.data.t(), scale_a=sa, scale_b=b.scale.contiguous().t(), out_dtype=acc_dtype)
    if bias is not None:
        y = (y + bias.float()).to(out_dtype)
    return y


def probe(pair: str, device: torch.device) -> tuple:
    """A small random problem of ``pair``: M and N not multiples of 128, K of 256."""
    from ...quant import quantize

    a_recipe, _, b_recipe = pair.partition(" x ")
    g = torch.Generator(device=device).manual_seed(0)
    a = quantize(torch.randn(200, 256, device=device, generator=g), a_recipe)
    b = quantize(torch.randn(272, 256, device=device, generator=g), b_recipe)
    return a, b, torch.bfloat16, None
