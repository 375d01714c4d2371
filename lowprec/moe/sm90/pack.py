"""MoE token packing fused with 1x128 FP8 quantization (CuTe DSL)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ...cute.fp8_block import (
    LANES,
    THREADS,
    UNROLL,
    VEC,
    as_fp8,
    grid_1x128,
    load_blocks,
    scale_and_inverse,
)
from ...cute.pdl import after_previous_grid


# MoE token packing fused with 1x128 quantization. The grid walks the T tokens like quant_1x128
# (each block of x read and quantized once, not k times) and stores the codes to the token's
# packed rows ``slot_rows[t, j]`` (none where dropped). There are T·k packed rows, k per token: the
# group handling token t also zero-fills those of rows t·k .. t·k + k - 1 that are padding
# (``row_slots[p] == -1``), so every packed row is written exactly once, sized without a host sync.
# ``pack_tokens_1x128`` also stores the codes at the token's own row (quant_1x128 of x, which the
# MoE layer keeps for its backward pass) from the same registers.
@cute.kernel
def _pack_1x128_kernel(mX: cute.Tensor, mSlotRows: cute.Tensor, mRowSlots: cute.Tensor, mQ_u8: cute.Tensor,
                       mS: cute.Tensor, mXQ_u8: cute.Tensor, mXS: cute.Tensor, with_tokens: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    after_previous_grid()
    bidx, _, _ = cute.arch.block_idx()
    tokens = mX.shape[0]
    cols = mX.shape[1]
    top_k = mSlotRows.shape[1]
    blocks_per_row = mS.shape[1]
    mQ = as_fp8(mQ_u8)
    mXQ = as_fp8(mXQ_u8)

    lane = tidx % LANES
    values, coords = load_blocks(mX, bidx, tidx, blocks_per_row)
    zeros = cute.make_rmem_tensor((1, VEC), cutlass.Uint8)
    zeros.fill(0)
    for u in cutlass.range_constexpr(UNROLL):
        token, kb, col = coords[u]
        amax = abs(values[u]).reduce(cute.ReductionOp.MAX, Float32(0.0), 0)
        amax = cute.arch.warp_reduction_max(amax, threads_in_group=LANES)
        scale, inv = scale_and_inverse(amax)
        if token < tokens and col < cols:
            q_frag = cute.make_rmem_tensor((1, VEC), cutlass.Float8E4M3FN)
            q_frag.store((values[u] * inv).to(cutlass.Float8E4M3FN))
            if cutlass.const_expr(with_tokens):
                cute.autovec_copy(q_frag, cute.local_tile(mXQ, (1, VEC), (token, col // VEC)))
                if lane == 0:
                    mXS[token, kb] = scale
            for j in cutlass.range(top_k):
                dst = cutlass.Int32(mSlotRows[token, j])
                if dst >= 0:
                    cute.autovec_copy(q_frag, cute.local_tile(mQ, (1, VEC), (dst, col // VEC)))
                    if lane == 0:
                        mS[dst, kb] = scale
                pad = token * top_k + j
                if mRowSlots[pad] < 0:
                    cute.autovec_copy(zeros, cute.local_tile(mQ_u8, (1, VEC), (pad, col // VEC)))
                    if lane == 0:
                        mS[pad, kb] = Float32(1.0)


@cute.jit
def _launch_pack(mX: cute.Tensor, mSlotRows: cute.Tensor, mRowSlots: cute.Tensor, mQ_u8: cute.Tensor,
                 mS: cute.Tensor, mXQ_u8: cute.Tensor, mXS: cute.Tensor, with_tokens: cutlass.Constexpr, stream):
    grid = grid_1x128(mX.shape[0], mS.shape[1])
    _pack_1x128_kernel(mX, mSlotRows, mRowSlots, mQ_u8, mS, mXQ_u8, mXS, with_tokens).launch(
        grid=(grid, 1, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True)


@cute.jit
def pack_1x128(mX: cute.Tensor, mSlotRows: cute.Tensor, mRowSlots: cute.Tensor, mQ_u8: cute.Tensor,
               mS: cute.Tensor, stream):
    _launch_pack(mX, mSlotRows, mRowSlots, mQ_u8, mS, mQ_u8, mS, False, stream)


@cute.jit
def pack_tokens_1x128(mX: cute.Tensor, mSlotRows: cute.Tensor, mRowSlots: cute.Tensor, mQ_u8: cute.Tensor,
                      mS: cute.Tensor, mXQ_u8: cute.Tensor, mXS: cute.Tensor, stream):
    _launch_pack(mX, mSlotRows, mRowSlots, mQ_u8, mS, mXQ_u8, mXS, True, stream)
