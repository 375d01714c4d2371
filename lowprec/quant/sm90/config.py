"""What the sm_90a FP8 quantize kernels take, stated once (no cutlass import): the registry asks
these functions, each with the arguments of the kernel it guards."""

from __future__ import annotations

import math

import torch

from ...runtime.arch import GRID_YZ_MAX
from ..ops import DUAL_T_RECIPES as _DUAL_T_BY_ROWS

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
RECIPES = ("fp8_block1x128", "fp8_block128x128", "fp8_rowwise")  # with exact FP32 scales
COL_MULTIPLE = 16  # 16-byte rows of FP8 codes
DUAL_T_RECIPES = tuple(_DUAL_T_BY_ROWS.values())  # the dual kernels' transposed halves


def rows_unsupported(x: torch.Tensor) -> str | None:
    """Why the kernels cannot read ``x`` as [rows, cols] (None: they can)."""
    if x.dtype not in INPUT_DTYPES:
        return f"dtype {x.dtype}"
    if x.dim() != 2:
        return f"{x.dim()}-D input (the kernels take [rows, cols])"
    if x.shape[1] % COL_MULTIPLE or x.stride(1) != 1 or x.stride(0) % 16 or x.data_ptr() % 16:
        return f"cols must be a multiple of {COL_MULTIPLE}, rows contiguous and 16-byte aligned"
    return None


def _recipe_unsupported(x: torch.Tensor, r) -> str | None:
    if r.name not in RECIPES or r.scale_rounding != "exact":
        return f"recipe {r.name} ({r.scale_rounding} scales) has no quantize kernel"
    # one tall matrix: a block must not span two matrices (a batch of one has no second to span)
    if r.is_2d and x.dim() > 2 and x.shape[-2] % r.block[0] and math.prod(x.shape[:-2]) > 1:
        return f"the 128x128 kernel takes a batch of matrices only when rows are a multiple of {r.block[0]}"
    if r.is_2d and -(-x.shape[-1] // r.block[1]) > GRID_YZ_MAX:  # grid (row blocks, column blocks)
        return f"{x.shape[-1]} columns (the 128x128 kernel's grid: one y index per 128 columns, at most {GRID_YZ_MAX})"
    return None


def quantize_unsupported(x: torch.Tensor, r) -> str | None:
    """``quantize(x, r)``: ``x`` of any dims, viewed as [rows, cols]."""
    if x.shape[-1] == 0:
        return "no columns (nothing to quantize)"
    return _recipe_unsupported(x, r) or rows_unsupported(x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x)


def dual_unsupported(x: torch.Tensor, r, r_t) -> str | None:
    """``quantize_dual(x, r, r_t)``: ``x`` [T, K] in 1x128 blocks, ``xᵀ`` in 1x128, 16x128 or 128x128."""
    if r.name != "fp8_block1x128" or r.scale_rounding != "exact":
        return f"recipe {r.name}: the dual kernel quantizes exact 1x128 blocks"
    if r_t.name not in DUAL_T_RECIPES or r_t.scale_rounding != "exact":
        return f"recipe_t {r_t.name}: the dual kernel quantizes the transpose in exact {DUAL_T_RECIPES} blocks"
    return rows_unsupported(x)


def transpose_unsupported(x: torch.Tensor, r) -> str | None:
    """``quantize_with_transpose(x, r)``: a batch of matrices ``x`` [..., rows, cols] in 128x128 blocks."""
    if r.name != "fp8_block128x128":
        return f"recipe {r.name!r} (the transposing kernel is 128x128 FP8)"
    if x.shape[-2] == 0:
        return "no rows (nothing to quantize)"
    if x.shape[-2] % 16:
        return "rows per matrix must be a multiple of 16"
    return quantize_unsupported(x, r)


def gathered_unsupported(rows: torch.Tensor, r, sources: torch.Tensor) -> str | None:
    """The token-major 1x128 quantization of ``rows`` gathered through ``sources``."""
    if r.block != (1, 128) or r.name != "fp8_block1x128":
        return f"recipe {r.name}: the gathering kernel quantizes 1x128 blocks"
    if rows.dim() == 2 and -(-rows.shape[1] // 128) > GRID_YZ_MAX:  # grid (token blocks, column tiles)
        return f"{rows.shape[1]} columns (the gathering kernel's grid: a y per 128 columns, at most {GRID_YZ_MAX})"
    return rows_unsupported(rows)


def swiglu_dual_unsupported(*inputs: torch.Tensor) -> str | None:
    """The SwiGLU dual kernels: inputs of one shape [T, F] and one 16-bit dtype, rows readable."""
    x = inputs[0]
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {x.dtype} (the SwiGLU kernels take bf16 / fp16)"
    for t in inputs:
        if t.shape != x.shape or t.dtype != x.dtype:
            return "inputs of different shapes or dtypes"
        reason = rows_unsupported(t)
        if reason:
            return reason
    return None
