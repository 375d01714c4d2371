"""128x128 FP8 tiles in registers and their transposed staging in shared memory (CuTe DSL, no
torch): the pieces the 128x128 / dual quantize kernels (``lowprec.quant.sm90``) and the attention
pre-pass (``lowprec.attention.sm90.prepass``) share. Thread t of a 256-thread CTA holds columns
(t % 16) * 8 .. + 8 of 8 rows of the tile (VEC values each)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .fp8_block import LANES, THREADS, VEC, WARPS_PER_CTA


@cute.jit
def cta_max(amax, warp_max: cute.Tensor, tidx):
    """The maximum of every thread's ``amax`` in the CTA (``warp_max``: one smem slot per warp)."""
    return group_max(amax, warp_max, tidx, WARPS_PER_CTA)


@cute.jit
def group_max(amax, warp_max: cute.Tensor, t, warps: cutlass.Constexpr, barrier_id: cutlass.Constexpr = None):
    """The maximum of every thread's ``amax`` over a group of ``warps`` warps (``t``: the thread's
    index in the group; ``warp_max``: one smem slot per warp of the group), synchronized by the
    CTA barrier or, for a part of the CTA, by named barrier ``barrier_id``."""
    amax = cute.arch.warp_reduction_max(amax)
    if t % 32 == 0:
        warp_max[t // 32] = amax
    if cutlass.const_expr(barrier_id is None):
        cute.arch.sync_threads()
    else:
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=32 * warps)
    amax = warp_max[0]
    for w in cutlass.range_constexpr(1, warps):
        amax = cute.arch.fmax(amax, warp_max[w])
    return amax


# 128x128 tiles: one CTA per tile. Thread t holds columns (t % 16) * 8 .. + 8 of rows
# t // 16 + 16 * p, p = 0..7, in registers, so the tile is read from memory once.
TILE = 128
ROW_GROUPS = THREADS // LANES  # 16 rows per pass
PASSES = TILE // ROW_GROUPS  # 8


@cute.jit
def load_tile(mX: cute.Tensor, first_row, row_step: int, col):
    """The thread's PASSES x VEC values (rows ``first_row + row_step * p``) as FP32, zeros outside."""
    values = []
    for p in cutlass.range_constexpr(PASSES):
        r = first_row + row_step * p
        frag = cute.make_rmem_tensor((1, VEC), mX.element_type)
        frag.fill(0)
        if r < mX.shape[0] and col < mX.shape[1]:
            cute.autovec_copy(cute.local_tile(mX, (1, VEC), (r, col // VEC)), frag)
        values.append(frag.load().to(Float32))
    return values


# Transposed FP8 tiles (dual, 128x128 with transpose): a [column][token] smem tile of 128-byte
# rows whose 16-byte chunks are XOR-swizzled by (row / 8) % 8, so that the 8-byte column stores
# (rows 8 apart across a half-warp) and the 16-byte row reads (8 lanes per row) both spread over
# all banks.
def alloc_transposed_tile(smem):
    return smem.allocate_tensor(cutlass.Float8E4M3FN, cute.make_layout((TILE, TILE), stride=(TILE, 1)),
                                byte_alignment=128)


@cute.jit
def column_codes(values, j, inv):
    """FP8 codes of column ``j`` of the thread's 8x8 micro-tile ``values``, scaled by ``inv``."""
    column = cute.make_rmem_tensor((1, PASSES), Float32)
    for p in cutlass.range_constexpr(PASSES):
        column[0, p] = values[p][j] * inv
    codes = cute.make_rmem_tensor((1, PASSES), cutlass.Float8E4M3FN)
    codes.store(column.load().to(cutlass.Float8E4M3FN))
    return codes


@cute.jit
def stage_column(tile_t: cute.Tensor, codes: cute.Tensor, lane, rgrp, j):
    """The 8 codes of tile column ``lane * VEC + j``, tokens ``rgrp * 8 ..``: 8-byte chunk ``rgrp``
    of that row of ``tile_t``, its 16-byte chunk swizzled by (column / 8) % 8 = lane % 8."""
    chunk8 = ((rgrp // 2) ^ (lane % 8)) * 2 + rgrp % 2
    cute.autovec_copy(codes, cute.local_tile(tile_t, (1, PASSES), (lane * VEC + j, chunk8)))


@cute.jit
def store_transposed(tile_t: cute.Tensor, mQT: cute.Tensor, out_row0, out_row_end, out_col0, out_col_end, tidx,
                     permute_keys: cutlass.Constexpr = False):
    """Row c of ``tile_t`` -> ``mQT[out_row0 + c, out_col0 ..]`` by 16-byte chunks (8 lanes per row,
    32 rows per pass), rows below ``out_row_end`` and chunks starting below ``out_col_end``.
    ``permute_keys``: each chunk's bytes reordered 0,1,8,9,2,3,10,11,4,5,12,13,6,7,14,15 (the
    attention kernel's Vᵀ layout whose P needs no shuffles: ``attention.sm90.config.V_KEY_PERM``)."""
    q16 = tidx % 8
    for i in cutlass.range_constexpr(TILE * TILE // 16 // THREADS):
        c = i * (THREADS // 8) + tidx // 8
        if out_row0 + c < out_row_end and out_col0 + q16 * 16 < out_col_end:
            src = cute.local_tile(tile_t, (1, 16), (c, q16 ^ (c // 8 % 8)))
            dst = cute.local_tile(mQT, (1, 16), (out_row0 + c, (out_col0 + q16 * 16) // 16))
            if cutlass.const_expr(permute_keys):
                chunk = cute.make_rmem_tensor((1, 16), tile_t.element_type)
                cute.autovec_copy(src, chunk)
                words = cute.make_tensor(cute.recast_ptr(chunk.iterator, dtype=cutlass.Int32), cute.make_layout(4))
                out = cute.make_rmem_tensor(4, cutlass.Int32)
                for h in cutlass.range_constexpr(2):  # words h, h + 2 hold bytes 4h.. and 8 + 4h..
                    out[2 * h] = cutlass.Int32(cute.arch.prmt(words[h], words[h + 2], cutlass.Int32(0x5410)))
                    out[2 * h + 1] = cutlass.Int32(cute.arch.prmt(words[h], words[h + 2], cutlass.Int32(0x7632)))
                cute.autovec_copy(cute.make_tensor(cute.recast_ptr(out.iterator, dtype=tile_t.element_type),
                                                   cute.make_layout((1, 16), stride=(16, 1))), dst)
            else:
                cute.autovec_copy(src, dst)
