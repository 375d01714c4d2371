"""One decode step's append to an FP8 KV cache (CuTe DSL, sm_90a): one launch.

In torch ops an append was ~25 small kernels, ~550 µs of host time per step on the lent machine's
host against ~100 µs for a bf16 cache's whole step (``benchmarks/attention_kv_cache.py``). Here one
CTA per (batch row, KV head) does what :meth:`lowprec.attention.FP8KVCache.append` computes when
the new tokens stay inside the 128-token block being filled, and the row's last CTA advances its
length (no second launch for it):

- K: the block's amax so far (kept with its tokens, in the cache's float dtype) and the new tokens':
  the block's scale, the new tokens' codes, and the kept tokens' codes again only when the amax
  grew (a growing set's maximum moves ~ln 128 ≈ 5 times per block for random data); the new tokens
  copied into the kept ones;
- V: the new tokens times the channel's fixed inverse scale, saturated to E4M3, written into Vᵀ's
  columns (each key at its position in the forward's permuted order, ``V_KEY_PERM``); the values
  clipped by more than E4M3's rounding (past 464) counted with one 64-bit reduction per warp.

The arithmetic is the torch path's (``scale_and_inverse``: amax / 448, all-zero blocks 1; codes
``x · (1 / scale)`` rounded to nearest and saturated), so the bits are the same.

``kv_append_with_q`` (a decode step's append) also quantizes the step's query, one row per (batch
row, head), a warp per row: the bits of the rowwise Q pre-pass kernel, without its launch.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ...cute.fp8_block import as_fp8, scale_and_inverse
from ...cute.fp8_tile import group_max
from ...cute.pdl import after_previous_grid
from ..quantize import permuted_v_positions

THREADS = 256  # D / 2 threads per row (one per column pair), the rest of the CTA on further rows
BLOCK = 128  # tokens per K scale
SATURATES_PAST = 464.0


@cute.jit
def _load_pair(row: cute.Tensor, pair):
    frag = cute.make_rmem_tensor((2,), row.element_type)
    cute.autovec_copy(cute.local_tile(row, (2,), (pair,)), frag)
    return frag.load().to(Float32)


@cute.jit
def _store_codes(row: cute.Tensor, values, pair):
    codes = cute.make_rmem_tensor((2,), cutlass.Float8E4M3FN)
    codes.store(values.to(cutlass.Float8E4M3FN))
    cute.autovec_copy(codes, cute.local_tile(row, (2,), (pair,)))


@cute.kernel
def _kv_append_kernel(mKn: cute.Tensor, mVn: cute.Tensor, mTail: cute.Tensor, mAmax: cute.Tensor, mK_u8: cute.Tensor,
                      mKs: cute.Tensor, mVt_u8: cute.Tensor, mVinv: cute.Tensor, mCounts: cute.Tensor,
                      mPlan: cute.Tensor, mQ: cute.Tensor, mQc_u8: cute.Tensor, mQs: cute.Tensor, count: cutlass.Int32,
                      d: cutlass.Constexpr, pdl: cutlass.Constexpr, with_q: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    head, batch, _ = cute.arch.block_idx()
    if cutlass.const_expr(pdl):
        after_previous_grid()
    if cutlass.const_expr(with_q):
        _quantize_q_rows(mQ, mQc_u8, mQs, batch, head, mK_u8.shape[1], tidx, d)
    start = mPlan[batch, 5]  # the row's length
    if start + count <= mK_u8.shape[2]:
        _append_row(mKn, mVn, mTail, mAmax, mK_u8, mKs, mVt_u8, mVinv, mCounts, start, count, batch, head, tidx, d)
    elif tidx == 0 and head == 0:  # past max_len (a replayed graph): nothing written, counted
        cute.arch.red(mCounts.iterator + 1, cutlass.Int64(count), op="add", dtype="u64", sem="relaxed",
                      scope="gpu")
    # the row's length moves on once every head's CTA has read it: each CTA counts itself in field
    # 7 (after all its threads read field 5); the last one stores the new length and clears the count
    cute.arch.barrier()
    if tidx == 0:
        arrived = cute.arch.atomic_add(mPlan[batch, None].iterator + 7, cutlass.Int32(1), sem="acq_rel",
                                       scope="gpu")
        if arrived == mK_u8.shape[1] - 1:
            mPlan[batch, 7] = cutlass.Int32(0)
            mPlan[batch, 5] = start + count


@cute.jit
def _append_row(mKn, mVn, mTail, mAmax, mK_u8, mKs, mVt_u8, mVinv, mCounts, start, count, batch, head, tidx,
                d: cutlass.Constexpr):
    mK, mVt = as_fp8(mK_u8), as_fp8(mVt_u8)
    smem = cutlass.memory.SmemAllocator()
    warp_max = smem.allocate_tensor(Float32, cute.make_layout(THREADS // 32), byte_alignment=16)
    pairs = d // 2
    groups = THREADS // pairs  # rows handled at once
    pair, group = tidx % pairs, tidx // pairs
    first = start - start % BLOCK
    kept = start - first
    # K: the block's amax so far (kept beside its tokens) and the new tokens'
    old = Float32(0.0)
    if kept > 0:
        old = mAmax[batch, head]
    amax = old
    for r in cutlass.range(group, count, groups, unroll=1):
        x = _load_pair(mKn[batch, head, r, None], pair)
        amax = cute.arch.fmax(amax, abs(x).reduce(cute.ReductionOp.MAX, Float32(0.0), 0))
    amax = group_max(amax, warp_max, tidx, THREADS // 32)
    scale, inv = scale_and_inverse(amax)
    if tidx == 0:
        mAmax[batch, head] = amax
        mKs[batch, head, first // BLOCK] = scale
    if amax > old:  # the scale moved (uniform over the CTA): the kept tokens' codes too
        for r in cutlass.range(group, kept, groups, unroll=1):
            _store_codes(mK[batch, head, first + r, None], _load_pair(mTail[batch, head, r, None], pair) * inv, pair)
    saturated = cutlass.Int64(0)
    for r in cutlass.range(group, count, groups, unroll=1):
        src = mKn[batch, head, r, None]
        values = cute.make_rmem_tensor((2,), mTail.element_type)
        cute.autovec_copy(cute.local_tile(src, (2,), (pair,)), values)
        _store_codes(mK[batch, head, start + r, None], values.load().to(Float32) * inv, pair)
        cute.autovec_copy(values, cute.local_tile(mTail[batch, head, kept + r, None], (2,), (pair,)))
        # V: the new token at the channel's fixed scale, into Vᵀ's column of key start + r in the
        # forward's permuted key order
        column = permuted_v_positions(start + r)
        inv_v = cute.make_rmem_tensor((2,), Float32)
        cute.autovec_copy(cute.local_tile(mVinv[batch, head, None], (2,), (pair,)), inv_v)
        scaled = cute.make_rmem_tensor((2,), Float32)
        scaled.store(_load_pair(mVn[batch, head, r, None], pair) * inv_v.load())
        codes = cute.make_rmem_tensor((2,), cutlass.Float8E4M3FN)
        codes.store(scaled.load().to(cutlass.Float8E4M3FN))
        for j in cutlass.range_constexpr(2):
            mVt[batch, head, pair * 2 + j, column] = codes[j]
            if abs(scaled[j]) > Float32(SATURATES_PAST):
                saturated = saturated + cutlass.Int64(1)
    saturated = cute.arch.warp_reduction_sum(saturated)
    if tidx % 32 == 0 and saturated > cutlass.Int64(0):
        cute.arch.red(mCounts.iterator, saturated, op="add", dtype="u64", sem="relaxed", scope="gpu")


@cute.jit
def _quantize_q_rows(mQ, mQc_u8, mQs, batch, head, kv_heads, tidx, d: cutlass.Constexpr):
    """Rowwise FP8 codes and scales of the query heads that share KV head ``head`` (``mQ`` [B, H, 1, D],
    one row per head): a warp per row, D / 32 values per lane."""
    mQc = as_fp8(mQc_u8)
    per_lane = d // 32
    group = mQ.shape[1] // kv_heads
    warp, lane = tidx // 32, tidx % 32
    for j in cutlass.range(warp, group, THREADS // 32, unroll=1):
        h = head * group + j
        frag = cute.make_rmem_tensor((per_lane,), mQ.element_type)
        cute.autovec_copy(cute.local_tile(mQ[batch, h, 0, None], (per_lane,), (lane,)), frag)
        x = frag.load().to(Float32)
        amax = cute.arch.warp_reduction_max(abs(x).reduce(cute.ReductionOp.MAX, Float32(0.0), 0))
        scale, inv = scale_and_inverse(amax)
        codes = cute.make_rmem_tensor((per_lane,), cutlass.Float8E4M3FN)
        codes.store((x * inv).to(cutlass.Float8E4M3FN))
        cute.autovec_copy(codes, cute.local_tile(mQc[batch, h, 0, None], (per_lane,), (lane,)))
        if lane == 0:
            mQs[batch, h, 0] = scale


@cute.jit
def kv_append(mKn: cute.Tensor, mVn: cute.Tensor, mTail: cute.Tensor, mAmax: cute.Tensor, mK: cute.Tensor,
              mKs: cute.Tensor, mVt: cute.Tensor, mVinv: cute.Tensor, mCounts: cute.Tensor, mPlan: cute.Tensor,
              count: cutlass.Int32, d: cutlass.Constexpr, pdl: cutlass.Constexpr, stream):
    """Append ``count`` tokens (``mKn``, ``mVn`` [B, Hkv, count, D], any strides, rows contiguous)
    at each batch row's length (field 5 of ``mPlan`` [B, 8] int32, read on the device and advanced
    by ``count``; field 7 is the launch's arrival count, 0 before and after) in the cache
    (``mK`` [B, Hkv, max_len, D] and ``mVt`` [B, Hkv, D, padded] E4M3 codes, ``mKs`` [B, Hkv,
    blocks] K scales, ``mTail`` [B, Hkv, 128, D] the block's kept tokens and ``mAmax`` [B, Hkv]
    their amax, ``mVinv`` [B, Hkv, D] V's inverse scales, ``mCounts`` [2] int64: values saturated,
    tokens dropped past ``max_len``); ``length % 128 + count <= 128``, D dividing 256; ``pdl``:
    programmatic dependent launch."""
    # the query operands are unread without ``with_q``: K's stand in for them
    _kv_append_kernel(mKn, mVn, mTail, mAmax, mK, mKs, mVt, mVinv, mCounts, mPlan, mKn, mK, mKs, count, d, pdl,
                      False).launch(
        grid=(mK.shape[1], mK.shape[0], 1), block=(THREADS, 1, 1), stream=stream, use_pdl=pdl)


@cute.jit
def kv_append_with_q(mKn: cute.Tensor, mVn: cute.Tensor, mTail: cute.Tensor, mAmax: cute.Tensor, mK: cute.Tensor,
                     mKs: cute.Tensor, mVt: cute.Tensor, mVinv: cute.Tensor, mCounts: cute.Tensor, mPlan: cute.Tensor,
                     mQ: cute.Tensor, mQc: cute.Tensor, mQs: cute.Tensor, count: cutlass.Int32, d: cutlass.Constexpr,
                     pdl: cutlass.Constexpr, stream):
    """:func:`kv_append` of a decode step, which also quantizes its query ``mQ`` [B, H, 1, D] (H a
    multiple of the cache's KV heads, D a multiple of 32, rows contiguous) rowwise: E4M3 codes into
    ``mQc`` [B, H, 1, D] (uint8) and FP32 scales into ``mQs`` [B, H, 1]."""
    _kv_append_kernel(mKn, mVn, mTail, mAmax, mK, mKs, mVt, mVinv, mCounts, mPlan, mQ, mQc, mQs, count, d, pdl,
                      True).launch(grid=(mK.shape[1], mK.shape[0], 1), block=(THREADS, 1, 1), stream=stream,
                                   use_pdl=pdl)
