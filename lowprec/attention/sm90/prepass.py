"""The FP8 attention pre-pass kernels (CuTe DSL, sm_90a): K smoothed and quantized, V quantized
and transposed, each in one pass over its input. Memory-bound; bit-identical to the torch path of
:mod:`lowprec.attention.quantize` (the same FP32 arithmetic and the quantize kernels' rounding).

- ``k_smooth_quant``: one CTA per 128-token block of one head, all D columns (D <= 256: up to two
  128-column tiles in registers): ``k - k_mean`` in FP32, the block's amax, codes and scale.
  The mean (an FP32 column sum over the sequence) is a torch reduction before it.
- ``v_quant_t``: one CTA per 128 tokens x 128 channels of one head: codes ``v · inv_scale[channel]``
  staged transposed in shared memory and stored as rows of ``v_t`` (16-byte stores), tokens past
  Sk as zeros up to ``round_up(Sk, 16)``; each channel's scale from its amax over the sequence
  (a torch reduction before it), written by the first token tile. The fused attention call has it
  store each 16 tokens in the order the forward kernel reads without shuffles (``V_KEY_PERM``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ...cute.fp8_block import LANES, THREADS, VEC, WARPS_PER_CTA, as_fp8, scale_and_inverse, store_row_chunk
from ...cute.fp8_tile import (
    PASSES,
    ROW_GROUPS,
    TILE,
    alloc_transposed_tile,
    column_codes,
    cta_max,
    load_tile,
    stage_column,
    store_transposed,
)


@cute.jit
def _column_vector(mVec: cute.Tensor, row, col, cols):
    """``mVec[row, col .. col + VEC]`` converted to FP32 (zeros past ``cols``)."""
    frag = cute.make_rmem_tensor((1, VEC), mVec.element_type)
    frag.fill(0)
    if col < cols:
        cute.autovec_copy(cute.local_tile(mVec, (1, VEC), (row, col // VEC)), frag)
    return frag.load().to(Float32)


@cute.kernel
def _k_smooth_quant_kernel(mK: cute.Tensor, mMean: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor,
                           seqlen: cutlass.Int32, d_tiles: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    block, _, _ = cute.arch.block_idx()
    mQ = as_fp8(mQ_u8)
    smem = cutlass.memory.SmemAllocator()
    warp_max = smem.allocate_tensor(Float32, cute.make_layout(WARPS_PER_CTA), byte_alignment=16)
    lane, rgrp = tidx % LANES, tidx // LANES
    row0 = block * TILE  # seqlen % 128 == 0: a block never spans two heads
    head = row0 // seqlen
    d = mK.shape[1]
    values = []
    amax = Float32(0.0)
    for ct in cutlass.range_constexpr(d_tiles):
        col = ct * TILE + lane * VEC
        mean = _column_vector(mMean, head, col, d)
        tile = load_tile(mK, row0 + rgrp, ROW_GROUPS, col)
        for p in cutlass.range_constexpr(PASSES):
            tile[p] = tile[p] - mean  # columns past D: 0 - 0
            amax = cute.arch.fmax(amax, abs(tile[p]).reduce(cute.ReductionOp.MAX, Float32(0.0), 0))
        values.append(tile)
    amax = cta_max(amax, warp_max, tidx)
    scale, inv = scale_and_inverse(amax)
    for ct in cutlass.range_constexpr(d_tiles):
        col = ct * TILE + lane * VEC
        if col < d:
            for p in cutlass.range_constexpr(PASSES):
                store_row_chunk(mQ, values[ct][p] * inv, row0 + rgrp + ROW_GROUPS * p, col)
    if tidx == 0:
        mS[block, 0] = scale


@cute.jit
def k_smooth_quant(mK: cute.Tensor, mMean: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor,
                   seqlen: cutlass.Int32, d_tiles: cutlass.Constexpr, stream):
    """``mK`` [B·H·S, D] (S % 128 == 0), ``mMean`` [B·H, D] FP32 -> codes [B·H·S, D], scales
    [B·H·S/128, 1]."""
    _k_smooth_quant_kernel(mK, mMean, mQ_u8, mS, seqlen, d_tiles).launch(
        grid=(mK.shape[0] // TILE, 1, 1), block=(THREADS, 1, 1), stream=stream)


@cute.kernel
def _v_quant_t_kernel(mV: cute.Tensor, mAmax: cute.Tensor, mVt_u8: cute.Tensor, mScale: cute.Tensor,
                      seqlen: cutlass.Int32, permute_keys: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    token_tile, col_tile, head = cute.arch.block_idx()
    smem = cutlass.memory.SmemAllocator()
    tile_t = alloc_transposed_tile(smem)
    mVt = as_fp8(mVt_u8)
    lane, rgrp = tidx % LANES, tidx // LANES
    d = mV.shape[1]
    col = col_tile * TILE + lane * VEC
    # 8 consecutive tokens per thread: each channel's 8 codes are one 8-byte chunk of the
    # transposed tile
    token0 = token_tile * TILE + rgrp * PASSES
    values = []
    for p in cutlass.range_constexpr(PASSES):
        frag = cute.make_rmem_tensor((1, VEC), mV.element_type)
        frag.fill(0)
        if token0 + p < seqlen and col < d:
            cute.autovec_copy(cute.local_tile(mV, (1, VEC), (head * seqlen + token0 + p, col // VEC)), frag)
        values.append(frag.load().to(Float32))
    amax = _column_vector(mAmax, head, col, d)
    for j in cutlass.range_constexpr(VEC):
        scale, inv = scale_and_inverse(amax[j])
        stage_column(tile_t, column_codes(values, j, inv), lane, rgrp, j)
        if token_tile == 0 and rgrp == 0 and col < d:  # one writer per channel
            mScale[head, col + j] = scale
    cute.arch.sync_threads()
    store_transposed(tile_t, mVt, head * d + col_tile * TILE, head * d + d, token_tile * TILE, mVt.shape[1], tidx,
                     permute_keys)


@cute.jit
def v_quant_t(mV: cute.Tensor, mAmax: cute.Tensor, mVt_u8: cute.Tensor, mScale: cute.Tensor, seqlen: cutlass.Int32,
              heads: cutlass.Int32, permute_keys: cutlass.Constexpr, stream):
    """``mV`` [B·H·S, D], ``mAmax`` [B·H, D] in V's dtype (each channel's amax over the sequence)
    -> ``v_t`` codes [B·H·D, S_pad] (S_pad = round_up(S, 16); the padding tokens as zeros; with
    ``permute_keys`` the tokens of each aligned 16 stored in ``config.V_KEY_PERM`` order) and
    ``mScale`` [B·H, D] FP32 (the quantizer's scale of each amax)."""
    _v_quant_t_kernel(mV, mAmax, mVt_u8, mScale, seqlen, permute_keys).launch(
        grid=((mVt_u8.shape[1] + TILE - 1) // TILE, (mV.shape[1] + TILE - 1) // TILE, heads),
        block=(THREADS, 1, 1), stream=stream)
