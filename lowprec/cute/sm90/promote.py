"""FP32 promotion of wgmma block accumulators (DeepGEMM-style fine-grained scaling).

An FP8 wgmma adds its products with ~14 effective mantissa bits, so a long reduction is split
into blocks (e.g. 128 along K): each block is computed into a fresh register accumulator ``blk``
and folded into the FP32 accumulator with its scales, ``acc += blk * row_scale * col_scale``.

Register order of an sm_90 wgmma accumulator fragment (per thread, any N): value
``v = c + 2*r + 4*j`` sits at row ``rows[r]`` (r = 0, 1: +8 rows) and column ``col0 + 8*j + c``
(c = 0, 1; j over the N/8 column groups). ``row_scales`` are the two per-row scales of a thread;
the column scales come in two forms:

* one per column (:func:`promote_per_col`; ``col_scale(j, c)`` gives column ``8j + c``'s, from
  registers or read from shared memory right there),
* one per block of ``col_block`` columns (:func:`promote_col_blocks`; e.g. 128x128 weight
  scales), the block boundaries given relative to the fragment's first column.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

__all__ = ["promote_per_col", "promote_col_blocks"]


@cute.jit
def promote_per_col(acc: cute.Tensor, blk: cute.Tensor, row_scales, col_scale):
    """acc += blk * (row_scales[r] * col_scale(j, c)) for the thread's column 8j + c (traced
    inline: ``col_scale`` may read registers or shared memory)."""
    for j in cutlass.range_constexpr(cute.size(acc) // 4):
        for c in cutlass.range_constexpr(2):
            s_col = col_scale(j, c)
            for r in cutlass.range_constexpr(2):
                v = c + 2 * r + 4 * j
                acc[v] = acc[v] + blk[v] * (row_scales[r] * s_col)


@cute.jit
def promote_col_blocks(acc: cute.Tensor, blk: cute.Tensor, row_scales, block_scales, num_blocks: cutlass.Constexpr,
                       split, straddle: cutlass.Constexpr, col_block: cutlass.Constexpr = 128):
    """acc += blk * row_scales[r] * block_scales[i] where column block i covers the fragment's
    columns ``[split + col_block*(i-1), split + col_block*i)`` (block 0: up to ``split``).

    ``straddle`` False: the fragment's columns start at a multiple of ``col_block`` or of its
    width, block i = column // col_block. Otherwise ``split`` (a multiple of 16, so a group of 8
    columns never straddles) is a Python int (the choice is made when tracing) or a dynamic
    value (one select per column group and block)."""
    # one product per (row, column block)
    p = [[row_scales[r] * block_scales[i] for r in range(2)] for i in range(num_blocks)]
    for j in cutlass.range_constexpr(cute.size(acc) // 4):
        for r in cutlass.range_constexpr(2):
            if cutlass.const_expr(straddle):
                s = p[0][r]
                for i in cutlass.range_constexpr(1, num_blocks):
                    if cutlass.const_expr(isinstance(split, int)):
                        if cutlass.const_expr(8 * j >= split + col_block * (i - 1)):
                            s = p[i][r]
                    else:
                        s = cutlass.select_(8 * j < split + col_block * (i - 1), s, p[i][r])
            else:
                s = p[8 * j // col_block][r]
            for c in cutlass.range_constexpr(2):
                v = c + 2 * r + 4 * j
                acc[v] = acc[v] + blk[v] * s
