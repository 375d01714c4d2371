"""Reference quantize / dequantize in plain torch: the semantics every quantize kernel matches.

All arithmetic is FP32, in this order (kernels must reproduce it to be bit-identical):
``amax`` per block -> scale (see :mod:`lowprec.recipes`) -> ``inv = 1 / scale`` (IEEE division,
once per block) -> ``q = x * inv`` -> clamp to the element format's range -> round to nearest
even. (A multiply per element, not a division: kernels stay memory-bound.)

The amax ignores NaN (as the kernels' max does), so with ``check_finite=False`` a NaN's block is
scaled by its finite values and the NaN stays NaN (E2M1, which has no NaN: 0).
"""

from __future__ import annotations

import torch

from ..blocks import block_dims, dequantize_blocks, expand_scale
from ..formats import E4M3, E8M0_NAN, encode, encode_e8m0, pack_fp4, pow2
from ..recipes import ScaleRecipe
from ..tensor import QuantizedTensor

__all__ = ["quantize_reference", "dequantize_reference", "scale_from_amax", "block_dims", "ieee_div"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_FP32_TINY = torch.finfo(torch.float32).tiny
_FP32_MIN_SUBNORMAL = 2.0**-149


def ieee_div(a: torch.Tensor, b: float | torch.Tensor) -> torch.Tensor:
    """IEEE division (correctly rounded to ``a``'s dtype) on every device and under ``torch.compile``:
    CUDA turns division by a Python scalar into a reciprocal multiply, and inductor's Triton divides
    FP32 approximately (``div.full``, off by an ulp). Computed in FP64 and rounded once: for FP32 and
    narrower that is the IEEE quotient (FP64 has more than twice their precision, plus two bits)."""
    wide = a.to(torch.float64)
    if isinstance(b, torch.Tensor):
        return (wide / b.to(dtype=torch.float64, device=a.device)).to(a.dtype)
    # a fill, not a host copy: CUDA-graph capturable
    return (wide / torch.full((), b, dtype=torch.float64, device=a.device)).to(a.dtype)


def _pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    mant, exp = torch.frexp(s)  # s = mant * 2^exp, mant in [0.5, 1)
    # Inf (a block with an Inf, check_finite=False) stays Inf: frexp gives it exponent 0, i.e. 1
    return torch.where((mant == 0.5) | ~torch.isfinite(s), s, pow2(exp, s.dtype))


def scale_from_amax(amax: torch.Tensor, recipe: ScaleRecipe, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Block scales (FP32 values; E8M0/E4M3 recipes: already rounded to that format) from FP32 amax.

    All-zero blocks get a finite non-zero scale: 1 for FP32 scales, the smallest code otherwise.
    """
    elem_max = recipe.element.max
    if recipe.scale_format == "fp32":
        s = ieee_div(amax, elem_max)
        if recipe.scale_rounding == "pow2":
            s = _pow2_ceil(torch.where(s > 0, s, torch.ones_like(s)))
        s = torch.where(amax > 0, s.clamp(min=_FP32_TINY), torch.ones_like(s))
        return s
    if recipe.scale_format == "e8m0":
        if recipe.scale_rounding == "rceil":
            codes = encode_e8m0(ieee_div(amax, elem_max), "ceil")
        else:
            codes = encode_e8m0(amax, "floor").to(torch.int32) - recipe.element.emax
            codes = torch.where(amax > 0, codes, torch.zeros_like(codes)).clamp(0, 254)
            # an Inf amax has no exponent: its block's scale is NaN (as with 'rceil'), not 2^(254 - emax)
            codes = torch.where(amax.isinf(), torch.full_like(codes, E8M0_NAN), codes).to(torch.uint8)
        return codes.view(torch.float8_e8m0fnu).float()
    if global_scale is None:  # E4M3 block scales are relative to it (else an opaque error from torch.full)
        raise ValueError(f"global_scale: recipe {recipe.name!r} (E4M3 block scales) needs the FP32 global scale, "
                         f"got None")
    # e4m3 block scale under an FP32 global scale (NVFP4); at least the scale whose product with
    # the global scale is not flushed to 0 in FP32 (2^-149 / global_scale: above 2^-9 only for
    # tensors of FP32 subnormals)
    s = ieee_div(ieee_div(amax, elem_max), global_scale)
    s = torch.maximum(s.clamp(max=E4M3.max), ieee_div(torch.full_like(global_scale, _FP32_MIN_SUBNORMAL), global_scale)
                      .clamp(min=E4M3.min_subnormal, max=E4M3.max))
    return s.to(torch.float8_e4m3fn).float()


def _blocked_amax(a: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """max over [br, bc] blocks of the last two dims of ``a`` (magnitudes, zero-padded), FP32."""
    rows, cols = a.shape[-2:]
    pr, pc = -rows % br, -cols % bc
    a = torch.nn.functional.pad(a, (0, pc, 0, pr))
    lead = a.shape[:-2]
    a = a.reshape(*lead, (rows + pr) // br, br, (cols + pc) // bc, bc)
    return a.amax(dim=(-3, -1))


def quantize_reference(x: torch.Tensor, recipe: ScaleRecipe) -> QuantizedTensor:
    """Quantize ``x`` (validated by the caller) with ``recipe`` in plain torch."""
    shape = x.shape
    x2 = x.reshape(1, shape[0]) if x.dim() == 1 else x
    xf = x2.to(torch.float32)
    br, bc = block_dims(recipe, shape)
    rows, cols = x2.shape[-2:]

    mag = xf.abs().nan_to_num(nan=0.0, posinf=torch.inf)
    if recipe.tensorwise:
        amax = mag.amax() if xf.numel() else xf.new_zeros(())
        amax = amax.reshape([1] * x2.dim())
    else:
        amax = _blocked_amax(mag, br, bc)

    global_scale = None
    if recipe.global_scale:
        amax_t = amax.amax() if amax.numel() else amax.new_zeros(())
        # at least the smallest FP32 subnormal: a tensor of subnormals would get 0
        global_scale = torch.where(amax_t > 0, ieee_div(amax_t, E4M3.max * recipe.element.max).clamp(
            min=_FP32_MIN_SUBNORMAL), torch.ones_like(amax_t))
    scale = scale_from_amax(amax, recipe, global_scale)
    divisor = scale if global_scale is None else scale * global_scale
    inv = expand_scale(ieee_div(torch.ones_like(divisor), divisor), br, bc, rows, cols)
    q = xf * inv
    if global_scale is not None:
        # below 2^-128 (a global scale of tiny inputs) 1 / divisor overflows FP32: divide there.
        # FP32 and E8M0 scales are ≥ 2^-127, so their reciprocals are finite.
        # (a plain division of the whole tensor: ieee_div's FP64 copy would double its memory; only
        # these inputs, far below any real data, could differ by an ulp under inductor's Triton)
        q = torch.where(inv.isinf(), xf / expand_scale(divisor, br, bc, rows, cols), q)
    q = q.clamp(-recipe.element.max, recipe.element.max)

    if recipe.is_fp4:
        codes = encode(q, recipe.element)
        if cols % 2:
            codes = torch.nn.functional.pad(codes, (0, 1))
        data = pack_fp4(codes, check_range=False)  # E2M1 codes from encode
    else:
        data = q.to(recipe.element.torch_dtype)
    if x.dim() == 1:
        data = data[0]
        scale = scale.reshape(scale.shape[-1])
    if recipe.scale_format == "e8m0":
        scale = encode_e8m0(scale, "nearest").view(torch.float8_e8m0fnu)
    elif recipe.scale_format == "e4m3":
        scale = scale.to(torch.float8_e4m3fn)
    return QuantizedTensor(data, scale.contiguous(), recipe, shape, x.dtype, global_scale)


def dequantize_reference(qt: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``q * scale (* global_scale)`` with the logical shape (:func:`lowprec.blocks.dequantize_blocks`)."""
    return dequantize_blocks(qt, dtype)
