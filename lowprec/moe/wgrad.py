"""Weight gradients of grouped GEMMs: the K-grouped GEMM ``dW[e] = dYₑᵀ · Xₑ`` over each expert's tokens.

Here the reduction runs over tokens, so both operands are quantized along the token dim (1x128
blocks of 128 tokens). A block must not mix two experts: :func:`quantize_k_grouped` transposes the
packed rows and starts every expert's tokens at a multiple of 128, zero-padding the gap.

On Hopper, FP8 1x128 operands run the K-grouped mode of the block-scaled GEMM kernel
(:func:`lowprec.gemm.sm90.interface.grouped_gemm_wgrad_fp8`): one launch over all experts, the
group ends read on the device (no host sync).
"""

from __future__ import annotations

import torch

from ..gemm import check_out_dtype
from ..quant import quantize_dual
from ..recipes import WHOLE, ScaleRecipe, get_recipe
from ..runtime import eager_under_compile, kernel_failed, registry
from ..tensor import QuantizedTensor

__all__ = ["grouped_gemm_wgrad", "quantize_k_grouped"]

_ALIGN = 128


def _check_ends(group_ends: torch.Tensor, device: torch.device) -> None:
    if not isinstance(group_ends, torch.Tensor) or group_ends.dtype not in (torch.int32, torch.int64) \
            or group_ends.dim() != 1 or group_ends.numel() == 0:
        raise ValueError(f"group_ends: expected a non-empty 1-D int32/int64 tensor, got "
                         f"{getattr(group_ends, 'dtype', type(group_ends))} {tuple(getattr(group_ends, 'shape', ()))}")
    if group_ends.device != device:
        raise ValueError(f"group_ends: on {group_ends.device}, but the rows are on {device}")


@eager_under_compile
def quantize_k_grouped(rows: torch.Tensor, group_ends: torch.Tensor, recipe: str | ScaleRecipe = "fp8_block1x128",
                       row_index: torch.Tensor | None = None) -> tuple[QuantizedTensor, torch.Tensor]:
    """Packed rows ``[M, C]`` to the K-grouped operand ``[C, round_up(M, 128) + 128·E]`` of :func:`grouped_gemm_wgrad`.

    Args:
        rows: ``[M, C]`` float rows grouped by expert: expert ``e`` owns rows
            ``group_ends[e-1]:group_ends[e]``; rows after ``group_ends[-1]`` are ignored.
            With ``row_index``, any ``[R, C]`` rows (e.g. one per token) that it indexes.
        group_ends: ``[E]`` int32 cumulative ends (non-decreasing, at most M; checked on the
            CPU, not on a GPU: no host sync).
        recipe: 1 x N block recipe with N dividing 128 (default ``fp8_block1x128``).
        row_index: optional ``[M]`` int32/int64 map: packed row ``p`` is ``rows[row_index[p]]``, a
            zero row where ``row_index[p] < 0``. Saves gathering token rows into packed order first
            (the GPU kernel reads them through the map); the result is the same bits. Entries
            must be below ``R``: checked on the CPU, not on a GPU (no host sync).

    Returns:
        ``(q, aligned_ends)``: ``q`` quantizes the transposed rows, expert ``e``'s tokens in
        columns ``aligned_ends[e-1]`` onwards (each group starts at a multiple of 128, ends
        zero-padded up to ``aligned_ends[e]``, a multiple of 128). The width
        ``round_up(M, 128) + 128·E`` bounds ``Σ round_up(count_e, 128)`` from the shapes alone (no
        sync to size it) and is a whole number of 128-wide blocks (the GEMM kernel's row stride).
    """
    if not isinstance(rows, torch.Tensor) or not rows.is_floating_point() or rows.dim() != 2:
        raise ValueError(f"rows: expected a 2-D float tensor [M, C], got "
                         f"{getattr(rows, 'dtype', type(rows))} {tuple(getattr(rows, 'shape', ()))}")
    _check_ends(group_ends, rows.device)
    if row_index is not None:
        # int32 / int64 only: a bool mask would be taken as rows 0 and 1
        if not isinstance(row_index, torch.Tensor) or row_index.dim() != 1 \
                or row_index.dtype not in (torch.int32, torch.int64) or row_index.device != rows.device:
            raise ValueError(f"row_index: expected a 1-D int32/int64 tensor on {rows.device}, got "
                             f"{getattr(row_index, 'dtype', type(row_index))} {tuple(getattr(row_index, 'shape', ()))} "
                             f"on {getattr(row_index, 'device', None)}")
        # on the CPU only: on a GPU the check would sync (the kernel reads through the map unchecked)
        if row_index.device.type == "cpu" and row_index.numel() and int(row_index.max()) >= rows.shape[0]:
            raise ValueError(f"row_index: expected entries below R={rows.shape[0]} (rows' count; negative for a "
                             f"zero row), got {int(row_index.max())}")
    r = get_recipe(recipe)
    if r.block[0] != 1 or r.block[1] == WHOLE or _ALIGN % r.block[1] or r.global_scale:
        raise ValueError(f"recipe: expected 1 x N blocks with N dividing {_ALIGN} and no global scale, "
                         f"got {r.name!r} with block {r.block}")
    m = rows.shape[0] if row_index is None else row_index.shape[0]
    if group_ends.device.type == "cpu":  # as row_index's range: on a GPU the check would sync
        ends = group_ends.tolist()
        if ends[0] < 0 or ends[-1] > m or any(b < a for a, b in zip(ends, ends[1:])):
            raise ValueError(f"group_ends: expected non-decreasing ends within [0, M={m}], got {ends}")
    (q,), aligned_ends = quantize_k_grouped_many([(rows, row_index)], group_ends, r, m)
    return q, aligned_ends


def quantize_k_grouped_many(operands: list[tuple[torch.Tensor, torch.Tensor | None]], group_ends: torch.Tensor,
                            r: ScaleRecipe, m: int) -> tuple[list[QuantizedTensor], torch.Tensor]:
    """:func:`quantize_k_grouped` of several ``(rows, row_index)`` (validated) over the same
    ``m`` packed rows and groups, the column layout computed once (the weight-gradient
    operands of one backward pass: ~15 small ops each time otherwise)."""
    num_groups = group_ends.numel()
    device = group_ends.device
    width = -(-m // _ALIGN) * _ALIGN + _ALIGN * num_groups
    ends = group_ends.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    aligned = (counts + _ALIGN - 1) // _ALIGN * _ALIGN
    aligned_ends = torch.cumsum(aligned, 0)
    # destination column of every row; rows outside the groups go to scratch columns (cut below)
    p = torch.arange(m, device=device)
    group = torch.searchsorted(ends, p, right=True)
    g = group.clamp(max=num_groups - 1)
    dest = torch.where(group < num_groups, aligned_ends[g] - aligned[g] + p - (ends[g] - counts[g]), width + p)
    sources: dict[int | None, torch.Tensor] = {}  # by row_index: the source row of every column
    out = []
    for rows, row_index in operands:
        key = None if row_index is None else id(row_index)
        if key not in sources:  # -1: zero padding; the kernel gathers the rows itself
            src = torch.full((width + m,), -1, dtype=torch.int32, device=device)
            sources[key] = src.index_copy_(0, dest, p.int() if row_index is None else row_index.int())[:width]
        args = (rows, r, sources[key])
        kernel = registry.kernel_for("quantize_t_gathered", rows.device, *args)
        if kernel is not None:
            try:
                qt, st = kernel(*args)
                out.append(QuantizedTensor(qt, st, r, (rows.shape[1], width), rows.dtype))
                continue
            except Exception as err:
                kernel_failed("quantize_t_gathered", err)
        if row_index is not None:  # gather: a zero row appended for the -1 entries
            src = torch.where(row_index >= 0, row_index, rows.shape[0])
            rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])[src]
        buf = rows.new_zeros(width + m, rows.shape[1]).index_copy_(0, dest, rows)
        # the token-major half of the dual quantization is quantize(buf[:width]ᵀ), read without a
        # transposed copy of buf (width is a multiple of 16: no padding columns)
        out.append(quantize_dual(buf[:width], r)[1])
    return out, aligned_ends.int()


@eager_under_compile
def grouped_gemm_wgrad(a: QuantizedTensor, b: QuantizedTensor, group_ends: torch.Tensor,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """K-grouped GEMM: ``out[e] = dequant(a)[:, Kₑ] · dequant(b)[:, Kₑ]ᵀ``, ``Kₑ = group_ends[e-1]:group_ends[e]``.

    For weight gradients ``dW[e] = dYₑᵀ · Xₑ``: pass ``a = dYᵀ`` and ``b = Xᵀ`` as
    :func:`quantize_k_grouped` builds them. FP32 accumulation; empty groups give zeros.

    Args:
        a: quantized ``[N, K]``, 1 x N blocks along K.
        b: quantized ``[P, K]``, 1 x N blocks along K.
        group_ends: ``[E]`` int32 cumulative ends along K, non-decreasing, at most K; every group
            starts at a multiple of both block widths, so no scale block spans two groups.
        out_dtype: default float32.

    Returns:
        ``[E, N, P]``.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, QuantizedTensor):
            raise TypeError(f"{name}: expected a QuantizedTensor (quantize_k_grouped), got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name}: expected 2 dims [rows, K], got shape {tuple(t.shape)}")
        if t.recipe.block[0] != 1 or t.recipe.block[1] == WHOLE:
            raise ValueError(f"{name}: expected 1 x N blocks along K, got {t.recipe.name!r}, block {t.recipe.block}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"b: K mismatch: a has K={a.shape[1]}, b has K={b.shape[1]}")
    if a.device != b.device:
        raise ValueError(f"b: on {b.device}, but a is on {a.device}")
    check_out_dtype(out_dtype)  # the kernel writes no other; the reference would cast to anything (int32 too)
    _check_ends(group_ends, a.device)
    return registry.run("grouped_gemm_wgrad", a.device, (a, b, group_ends, out_dtype),
                    lambda: _grouped_gemm_wgrad_reference(a, b, group_ends, out_dtype))


def _grouped_gemm_wgrad_reference(a: QuantizedTensor, b: QuantizedTensor, group_ends: torch.Tensor,
                                  out_dtype: torch.dtype) -> torch.Tensor:
    ends = group_ends.tolist()
    starts = [0, *ends[:-1]]
    k = a.shape[1]
    if any(e < s for s, e in zip(starts, ends)) or ends[-1] > k or ends[0] < 0:
        raise ValueError(f"group_ends: must be non-decreasing within [0, K={k}], got {ends}")
    widths = {a.recipe.block[1], b.recipe.block[1]}
    if any(s % w for s in starts for w in widths):
        raise ValueError(f"group_ends: every group must start at a multiple of the block width {sorted(widths)} "
                         f"(quantize_k_grouped aligns them), got {ends}")
    a_deq, b_deq = a.dequantize(torch.float32), b.dequantize(torch.float32)
    out = a_deq.new_zeros(len(ends), a.shape[0], b.shape[0])
    for e, (s, end) in enumerate(zip(starts, ends)):
        if end > s:
            out[e] = a_deq[:, s:end] @ b_deq[:, s:end].T
    return out.to(out_dtype)
