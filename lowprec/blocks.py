"""Block geometry of a recipe and dequantization, in plain torch: what a QuantizedTensor needs to
turn itself back into a tensor (below :mod:`lowprec.quant`, which quantizes)."""

from __future__ import annotations

import torch

from .formats import decode, unpack_fp4
from .recipes import WHOLE, ScaleRecipe
from .runtime.arch import on_operand_device

__all__ = ["block_dims", "expand_scale", "times_block_scales", "dequantize_blocks"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def block_dims(recipe: ScaleRecipe, shape: torch.Size) -> tuple[int, int]:
    """The concrete ``(rows, cols)`` of one block for a tensor of ``shape`` (WHOLE resolved)."""
    rows = shape[-2] if len(shape) >= 2 else 1
    cols = shape[-1]
    br, bc = recipe.block
    return (max(rows, 1) if br == WHOLE else br), (max(cols, 1) if bc == WHOLE else bc)


def expand_scale(scale: torch.Tensor, br: int, bc: int, rows: int, cols: int) -> torch.Tensor:
    """Broadcast a [..., nr, nc] block-scale grid to [..., rows, cols] (crop the padding)."""
    s = scale.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)
    return s[..., :rows, :cols]


@on_operand_device
def dequantize_blocks(qt, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``q * scale (* global_scale)`` of a QuantizedTensor ``qt`` with its logical shape.

    Computed in FP32, or in FP64 when ``dtype`` is float64 (exact: use it for error references).
    """
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype: expected one of {[str(d) for d in _FLOAT_DTYPES]} or None, got {dtype!r}")
    dtype = qt.dtype if dtype is None else dtype
    work = torch.float64 if dtype == torch.float64 else torch.float32
    shape = qt.shape
    rows, cols = (shape[-2], shape[-1]) if len(shape) >= 2 else (1, shape[-1])
    data = qt.data if len(shape) >= 2 else qt.data.reshape(1, -1)
    if qt.recipe.is_fp4:
        q = decode(unpack_fp4(data), qt.recipe.element, check_range=False)[..., :cols]  # nibbles
    else:
        q = data.float()
    # in the work dtype: an E4M3 block scale times the FP32 global scale needs 28 bits, so the
    # product rounds in FP32 and a float64 dequantization would not be exact
    scale = qt.scale.to(work)
    if len(shape) < 2:
        scale = scale.reshape(1, -1)
    if qt.global_scale is not None:
        scale = scale * qt.global_scale.to(work)
    br, bc = block_dims(qt.recipe, shape)
    q = q.to(work)
    out = times_block_scales(q, scale, br, bc)
    if dtype != torch.float64:
        # a finite code times its scale can lie past dtype's largest value (E8M0 / pow2 scales round a
        # block's amax up: fp16 65504 -> 256 · 2^8 = 65536), or overflow the FP32 product: saturate, as
        # the codes are finite (Inf codes, E5M2's, stay Inf; NaN stays NaN)
        big = torch.finfo(dtype).max
        sat = out.clamp(-big, big)
        out = torch.where(q.isinf(), out, sat) if qt.recipe.element.has_inf else sat
    return out.reshape(shape).to(dtype)


def times_block_scales(q: torch.Tensor, scale: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """``q [..., rows, cols]`` times its ``[..., ceil(rows/br), ceil(cols/bc)]`` block scales. Whole
    blocks broadcast each scale over a view of its block (no expanded scale tensor: a large
    dequantization moves a third fewer bytes); tails expand the grid. The same products either way."""
    rows, cols = q.shape[-2:]
    if rows % br or cols % bc or not q.numel():  # an empty tensor's grid (tensorwise: one scale) has no blocks
        return q * expand_scale(scale, br, bc, rows, cols)
    blocks = q.reshape(*q.shape[:-2], rows // br, br, cols // bc, bc)
    # the grid's leading dims broadcast as they are (a tensorwise scale has none)
    return (blocks * scale.reshape(*scale.shape[:-2], rows // br, 1, cols // bc, 1)).reshape(q.shape)
