"""Reference GEMMs in plain torch: the semantics the kernels are checked against.

Every product is an FP32 (or FP64) matmul of the dequantized operands, ``D = A · Bᵀ``.
"""

from __future__ import annotations

import torch

from ..runtime import autocast_off
from ..tensor import QuantizedTensor

__all__ = ["gemm_reference", "grouped_mm_rows", "grouped_gemm_contiguous_reference", "grouped_gemm_masked_reference"]


def gemm_reference(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias: torch.Tensor | None,
                   compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    with autocast_off(a.device):
        d = a.dequantize(compute_dtype) @ b.dequantize(compute_dtype).T
    if bias is not None:
        d = d + bias.to(compute_dtype)
    return d.to(out_dtype)


def grouped_mm_rows(a: torch.Tensor, b: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """Plain-tensor contiguous grouped matmul: rows of group ``e`` times ``b[e]ᵀ``, in ``a``'s dtype;
    rows after the last group are zero."""
    out = a.new_zeros(a.shape[0], b.shape[1])
    start = 0
    for expert, end in enumerate(group_ends.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ b[expert].T
        start = end
    return out


def grouped_gemm_contiguous_reference(a: QuantizedTensor, b: QuantizedTensor, group_ends: torch.Tensor,
                                      out_dtype: torch.dtype,
                                      compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    with autocast_off(a.device):
        out = grouped_mm_rows(a.dequantize(compute_dtype), b.dequantize(compute_dtype), group_ends)
    return out.to(out_dtype)


def grouped_gemm_masked_reference(a: QuantizedTensor, b: QuantizedTensor, counts: torch.Tensor,
                                  out_dtype: torch.dtype, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    with autocast_off(a.device):
        out = a.dequantize(compute_dtype) @ b.dequantize(compute_dtype).transpose(-1, -2)
    rows = torch.arange(a.shape[1], device=out.device)
    valid = rows[None, :] < counts.to(out.device)[:, None]
    return torch.where(valid[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device)).to(out_dtype)
