"""1x128 FP8 E4M3 block quantization in registers (CuTe DSL, no torch): the pieces the quantize
kernels (``lowprec.quant.sm90``) and the MoE kernels (``lowprec.moe.sm90``) share.

A 16-lane group holds one 1x128 block, VEC = 8 contiguous values per lane (one 16-byte load of
bf16); the block's amax is reduced with warp shuffles; codes are ``x · (1 / scale)`` converted
with ``cvt.rn.satfinite`` (one IEEE division per block, as the reference quantizer).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

VEC = 8  # elements per thread: one 16-byte load of bf16
BLOCK = 128
LANES = BLOCK // VEC  # threads per scale block
THREADS = 256
GROUPS_PER_CTA = THREADS // LANES
WARPS_PER_CTA = THREADS // 32
E4M3_MAX = 448.0
FP32_TINY = 1.1754943508222875e-38  # smallest normal: amax / 448 never flushes to zero


def as_fp8(codes_u8: cute.Tensor) -> cute.Tensor:
    """The kernels take FP8 outputs as uint8 tensors (TVM-FFI has no FP8 dtype): the same memory
    and layout, typed E4M3."""
    return cute.make_tensor(cute.recast_ptr(codes_u8.iterator, dtype=cutlass.Float8E4M3FN), codes_u8.layout)



@cute.jit
def scale_and_inverse(amax):
    scale = Float32(1.0)
    if amax > Float32(0.0):
        scale = cute.arch.fmax(amax / Float32(E4M3_MAX), Float32(FP32_TINY))
    return scale, Float32(1.0) / scale


@cute.jit
def store_row_chunk(mQ: cute.Tensor, values, r, col):
    q_frag = cute.make_rmem_tensor((1, VEC), cutlass.Float8E4M3FN)
    q_frag.store(values.to(cutlass.Float8E4M3FN))
    cute.autovec_copy(q_frag, cute.local_tile(mQ, (1, VEC), (r, col // VEC)))


UNROLL = 4  # scale blocks per 16-lane group: 4 independent 16-byte loads in flight per thread
# A CTA of the 1x128 kernels covers one 128-wide column block of ROWS_PER_CTA consecutive rows:
# its scales are one contiguous 256-byte run of the MN-major [KB, M] scale layout (whole sectors,
# no scattered 4-byte stores), and neighbouring CTAs read neighbouring blocks of the same rows.
ROWS_PER_CTA = GROUPS_PER_CTA * UNROLL


@cute.jit
def grid_1x128(rows, blocks_per_row, unroll: cutlass.Constexpr = UNROLL):
    rows_per_cta = GROUPS_PER_CTA * unroll
    return (rows + rows_per_cta - 1) // rows_per_cta * blocks_per_row


@cute.jit
def load_blocks(mX: cute.Tensor, bidx, tidx, blocks_per_row):
    """The thread's VEC values (FP32, zeros outside ``mX``) of each of its group's UNROLL 1x128
    blocks (the CTA's column block, rows 16 apart), and each block's ``(row, block column, first
    column)``."""
    values, coords = load_block_columns(mX, bidx, tidx, blocks_per_row, mX.shape[1], (0,))
    return [v[0] for v in values], coords


@cute.jit
def load_block_columns(mX: cute.Tensor, bidx, tidx, blocks_per_row, cols, offsets,
                        unroll: cutlass.Constexpr = UNROLL):
    """``load_blocks`` of the blocks of ``cols`` columns, each read at every column offset in
    ``offsets``: the values of a block are a list, one entry per offset. ``unroll`` blocks per
    16-lane group (a CTA covers ``GROUPS_PER_CTA * unroll`` rows)."""
    lane = tidx % LANES
    row_tile = bidx // blocks_per_row
    kb = bidx - row_tile * blocks_per_row
    col = kb * BLOCK + lane * VEC
    values = []
    coords = []
    for u in cutlass.range_constexpr(unroll):
        # for each u the CTA's 16 groups take 16 consecutive rows
        row = (row_tile * unroll + u) * GROUPS_PER_CTA + tidx // LANES
        per_offset = []
        for offset in offsets:
            frag = cute.make_rmem_tensor((1, VEC), mX.element_type)
            frag.fill(0)
            if row < mX.shape[0] and col < cols:
                cute.autovec_copy(cute.local_tile(mX, (1, VEC), (row, (offset + col) // VEC)), frag)
            per_offset.append(frag.load().to(Float32))
        values.append(per_offset)
        coords.append((row, kb, col))
    return values, coords


@cute.jit
def quantize_block(mQ: cute.Tensor, mS: cute.Tensor, values, row, kb, col, lane, in_bounds):
    """Quantize one 1x128 block held by 16 lanes (VEC ``values`` each) and store codes and scale;
    every lane joins the amax shuffle, in bounds or not."""
    amax = abs(values).reduce(cute.ReductionOp.MAX, Float32(0.0), 0)
    amax = cute.arch.warp_reduction_max(amax, threads_in_group=LANES)
    scale, inv = scale_and_inverse(amax)
    if in_bounds:
        store_row_chunk(mQ, values * inv, row, col)
        if lane == 0:
            mS[row, kb] = scale
