"""What the sm_90a MoE kernels take, stated once (no cutlass import): the registry asks these
functions, each with the arguments of the kernel it guards."""

from __future__ import annotations

import torch

from ...quant.sm90.config import INPUT_DTYPES, rows_unsupported
from ...runtime.arch import INT32_OFFSET_MAX

# dispatch plan: one CTA per chunk of THREADS slots, one thread per slot
THREADS = 1024
MAX_EXPERTS = 512  # the per-warp count table: 32 warps x E int32 in shared memory (64 KB at 512)
MAX_SLOTS = 1 << 17  # every CTA sums its experts' column of the chunk counts: keep that short
UNPACK_DTYPES = INPUT_DTYPES  # rows and output dtypes of the unpack kernel
PACK_RECIPE = "fp8_block1x128"


def topk_unsupported(scores: torch.Tensor, top_k: int) -> str | None:
    """The top-k ids of router ``scores`` [T, E]."""
    if scores.dtype != torch.float32 or scores.dim() != 2 or not scores.is_contiguous():
        return f"scores: the kernel takes contiguous float32 [T, E], got {scores.dtype} {tuple(scores.shape)}"
    if scores.shape[1] > MAX_EXPERTS:
        return f"E={scores.shape[1]} experts (the kernels take up to {MAX_EXPERTS})"
    # [T, E] of static row stride E and an Int32 row count (``interface.build_topk_kernel``)
    if scores.numel() > INT32_OFFSET_MAX:
        return f"T·E={scores.numel()} scores (the kernel reads [T, E] with 32-bit offsets row·E + e)"
    if not 1 <= top_k <= scores.shape[1]:
        return f"top_k={top_k} outside [1, E={scores.shape[1]}]"
    return None


def dispatch_unsupported(ids: torch.Tensor, num_experts: int, capacity: int | None) -> str | None:
    """The dispatch plan of expert ids ``ids`` [T·k]."""
    if num_experts > MAX_EXPERTS:
        return f"E={num_experts} experts (the kernels take up to {MAX_EXPERTS})"
    if ids.numel() > MAX_SLOTS:
        return f"T·k={ids.numel()} slots (the kernels take up to {MAX_SLOTS})"
    return None


def _index_unsupported(routing, *names: str) -> str | None:
    for name in names:
        index = getattr(routing, name)
        if index.dtype != torch.int64 or not index.is_contiguous():
            return f"routing.{name} must be contiguous int64 for the kernel"
    return None


def pack_unsupported(x: torch.Tensor, routing, r, with_tokens: bool) -> str | None:
    """Packing tokens ``x`` [T, H] into their experts' rows, quantized with ``r``."""
    if r.name != PACK_RECIPE or r.scale_rounding != "exact":
        return f"recipe {r.name} ({r.scale_rounding} scales) has no packing kernel"
    return _index_unsupported(routing, "slot_rows", "row_slots") or rows_unsupported(x)


def unpack_unsupported(rows: torch.Tensor, routing, weights, out_dtype: torch.dtype) -> str | None:
    """Combining packed ``rows`` [T·k, H] back to tokens in ``out_dtype``."""
    if rows.dtype not in UNPACK_DTYPES or out_dtype not in UNPACK_DTYPES:
        return f"rows {rows.dtype} -> {out_dtype}: the unpack kernel takes {[str(d) for d in UNPACK_DTYPES]}"
    return _index_unsupported(routing, "slot_rows") or rows_unsupported(rows)


def swiglu_unsupported(h: torch.Tensor, row_weights: torch.Tensor) -> str | None:
    """SwiGLU of ``h = [gate | up]`` [R, 2F] times the row weights, quantized 1x128."""
    if h.dim() != 2 or h.shape[1] % 32:
        return f"h: expected [R, 2F] with F a multiple of 16, got {tuple(h.shape)}"
    if row_weights.dtype != torch.float32 or not row_weights.is_contiguous():
        return "row weights must be contiguous float32"
    return rows_unsupported(h)


def swiglu_rows_unsupported(h: torch.Tensor) -> str | None:
    """SwiGLU of ``h = [gate | up]`` [R, 2F] in ``h``'s dtype."""
    if h.dim() != 2 or h.shape[1] % 32:
        return f"h: expected [R, 2F] with F a multiple of 16, got {tuple(h.shape)}"
    return rows_unsupported(h)


def swiglu_backward_unsupported(h, da: torch.Tensor, row_weights: torch.Tensor) -> str | None:
    """SwiGLU's backward from the saved FP8 ``h`` (a QuantizedTensor [R, 2F]) and ``da`` [R, F]."""
    f = da.shape[1]
    if f % 16 or tuple(h.shape) != (da.shape[0], 2 * f) or h.recipe.name != PACK_RECIPE:
        return f"expected h [R, 2F] FP8 1x128 and da [R, F] with F a multiple of 16, got {tuple(h.shape)}"
    if da.dtype != torch.float32 or not da.is_contiguous() or row_weights.dtype != torch.float32 \
            or not row_weights.is_contiguous():
        return "da and the row weights must be contiguous float32"
    if not h.data.is_contiguous():
        return "h's codes must be contiguous"
    return None
