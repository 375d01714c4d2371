"""Scale layouts: explicit, tested conversions between the plain row-major scale grid and what
kernels read.

- Row-major ``[..., rows, cols]``: what :func:`lowprec.quantize` returns.
- MN-major, TMA-aligned (Hopper, DeepGEMM): same logical shape, ``stride(-2) == 1`` and
  ``stride(-1) == round_up(rows, 16 / itemsize)`` so each column starts 16-byte aligned.
- Blocked 128x4 (Blackwell tcgen05 / cuBLAS block scaling): the grid zero-padded to multiples
  of 128 x 4, stored tile by tile (row-tile major); inside a tile, element ``(r, c)`` sits at
  ``(r % 32) * 16 + (r // 32) * 4 + c`` (512 bytes per tile of 1-byte scales).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "to_mn_major_tma_aligned",
    "empty_mn_major_tma_aligned",
    "empty_dual_outputs",
    "is_mn_major_tma_aligned",
    "to_row_major",
    "to_blocked",
    "from_blocked",
    "blocked_offset",
]


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _tma_align(dtype: torch.dtype) -> int:
    return max(16 // dtype.itemsize, 1)


def to_mn_major_tma_aligned(scale: torch.Tensor) -> torch.Tensor:
    """Same values and shape ``[..., rows, cols]``, laid out column-major with 16-byte aligned columns.

    Returns ``scale`` itself when it already has that layout.
    """
    if scale.dim() < 2:
        raise ValueError(f"scale: expected ≥ 2 dims [..., rows, cols], got shape {tuple(scale.shape)}")
    if is_mn_major_tma_aligned(scale):
        return scale
    rows, cols = scale.shape[-2:]
    ld = _round_up(rows, _tma_align(scale.dtype))
    buf = scale.new_zeros(*scale.shape[:-2], cols, ld)
    buf[..., :rows] = scale.transpose(-1, -2)
    return buf[..., :rows].transpose(-1, -2)


def empty_mn_major_tma_aligned(rows: int, cols: int, device, dtype=torch.float32) -> torch.Tensor:
    """Uninitialised ``[rows, cols]`` in the layout ``to_mn_major_tma_aligned`` produces (for
    kernels that write scales in place: no fill, no copy)."""
    if cols <= 1:  # a single column is already MN-major: as to_mn_major_tma_aligned keeps it
        return torch.empty(rows, cols, dtype=dtype, device=device)
    return torch.empty_strided((rows, cols), (1, _round_up(rows, _tma_align(dtype))), dtype=dtype, device=device)


def empty_dual_outputs(t: int, k: int, device, t_rows: int = 1) -> tuple[torch.Tensor, ...]:
    """Uninitialised outputs of the dual quantize kernels for ``x`` [T, K]: E4M3 codes [T, K] and
    their 1x128 scales (MN-major, TMA-aligned); E4M3 codes of the transpose [K, T_pad] (T_pad =
    round_up(T, 16)) and their scales in blocks of ``t_rows`` x 128 (rows of the transpose x
    tokens): 1 or 16, MN-major [ceil(K/t_rows), ceil(T/128)]; 128, row-major [ceil(K/128),
    ceil(T/128)]."""
    t_pad = _round_up(t, 16)
    q = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=device)
    s = empty_mn_major_tma_aligned(t, -(-k // 128), device)
    qt = torch.empty(k, t_pad, dtype=torch.float8_e4m3fn, device=device)
    if t_rows == 128:
        st = torch.empty(-(-k // 128), -(-t_pad // 128), dtype=torch.float32, device=device)
    else:
        st = empty_mn_major_tma_aligned(-(-k // t_rows), -(-t_pad // 128), device)
    return q, s, qt, st


def is_mn_major_tma_aligned(scale: torch.Tensor) -> bool:
    """True when ``scale`` is column-major with 16-byte aligned columns and a dense batch stride."""
    if scale.dim() < 2:
        return False
    rows, cols = scale.shape[-2:]
    ld = _round_up(rows, _tma_align(scale.dtype))
    if scale.stride(-2) != 1 and rows > 1:
        return False
    if scale.stride(-1) != ld and cols > 1:
        return False
    expected = ld * cols
    for size, stride in zip(reversed(scale.shape[:-2]), reversed(scale.stride()[:-2])):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return scale.data_ptr() % 16 == 0


def to_row_major(scale: torch.Tensor) -> torch.Tensor:
    """Plain contiguous row-major scales (inverse of :func:`to_mn_major_tma_aligned`): a copy, or
    ``scale`` itself when it is contiguous already (as ``Tensor.contiguous``)."""
    return scale.contiguous()


def blocked_offset(row: int, col: int, cols: int) -> int:
    """Offset of grid element ``(row, col)`` in :func:`to_blocked` output for a grid of ``cols`` columns."""
    col_tiles = _round_up(cols, 4) // 4
    tile = (row // 128) * col_tiles + col // 4
    r = row % 128
    return tile * 512 + (r % 32) * 16 + (r // 32) * 4 + col % 4


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """Row-major ``[rows, cols]`` scale grid -> flat 128x4-tiled (swizzled) layout, zero-padded.

    Output is 1-D with ``round_up(rows, 128) * round_up(cols, 4)`` elements, same dtype. A stack
    of grids ``[..., rows, cols]`` gives their tiled layouts one after the other (a batched
    GEMM's scales).
    """
    if scale.dim() < 2:
        raise ValueError(f"scale: expected a [..., rows, cols] grid, got shape {tuple(scale.shape)}")
    *batch, rows, cols = scale.shape
    pr, pc = _round_up(rows, 128), _round_up(cols, 4)
    padded = scale.new_zeros(*batch, pr, pc)
    padded[..., :rows, :cols] = scale
    # [b, rt, 4, 32, ct, 4] (row = rt*128 + j*32 + i) -> [b, rt, ct, i, j, 4]
    tiles = padded.reshape(math.prod(batch), pr // 128, 4, 32, pc // 4, 4).permute(0, 1, 4, 3, 2, 5)
    return tiles.reshape(-1)


def from_blocked(blocked: torch.Tensor, rows: int, cols: int, batch: tuple[int, ...] = ()) -> torch.Tensor:
    """Inverse of :func:`to_blocked`: flat tiled scales -> row-major ``[*batch, rows, cols]``
    (``batch``: the leading shape of the stack of grids that :func:`to_blocked` was given)."""
    pr, pc = _round_up(rows, 128), _round_up(cols, 4)
    batch = tuple(batch)
    count = math.prod(batch)
    if blocked.dim() != 1 or blocked.numel() != count * pr * pc:
        grids = f"{count} {rows}x{cols} grids" if batch else f"a {rows}x{cols} grid"
        raise ValueError(
            f"blocked: expected a 1-D tensor of {count * pr * pc} elements for {grids}, "
            f"got shape {tuple(blocked.shape)}"
        )
    tiles = blocked.view(count, pr // 128, pc // 4, 32, 4, 4).permute(0, 1, 4, 3, 2, 5)
    return tiles.reshape(*batch, pr, pc)[..., :rows, :cols].contiguous()
