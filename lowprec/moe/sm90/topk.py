"""The router's top-k expert ids in one CuTe DSL kernel (sm_90a): the ids that
``torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]`` lists, without the
segmented sort and its copies (five launches at decode sizes).

One warp per token row, four rows per CTA; lane ``l`` holds the scores of experts ``l, l + 32, ...``.
Each score becomes a signed 32-bit key in torch's sort order: its bits, with the magnitude bits of
a negative value flipped, -0 equal to +0 and NaN above everything (torch sorts NaN as the largest
value). Then ``k`` rounds: each lane's best (highest key,
then lowest id: the stable sort's first), a warp max over (key, id) by butterfly shuffles, and the
winner retired from its lane. The scores are read as int32 bits (a view on the host).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ...cute.pdl import after_previous_grid

ROWS_PER_CTA = 4
RETIRED = -(1 << 31)  # below every score's key (that key would be a NaN's bits, which map to the top)


@cute.jit
def _sort_key(bits: Int32) -> Int32:
    """The order-preserving key of an FP32 value given as its bits (-0 the key of +0)."""
    magnitude = bits & Int32(0x7FFFFFFF)
    key = cutlass.select_(bits < 0, bits ^ Int32(0x7FFFFFFF), bits)
    key = cutlass.select_(magnitude == Int32(0), Int32(0), key)
    return cutlass.select_(magnitude > Int32(0x7F800000), Int32(0x7FFFFFFF), key)


@cute.kernel
def _topk_kernel(mBits: cute.Tensor, mIds: cute.Tensor, num_experts: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    after_previous_grid()
    bidx, _, _ = cute.arch.block_idx()
    lane = tidx % 32
    row = bidx * ROWS_PER_CTA + tidx // 32
    per_lane = (num_experts + 31) // 32
    top_k = mIds.shape[1]
    if row < mBits.shape[0]:
        keys = cute.make_rmem_tensor((per_lane,), Int32)
        for i in cutlass.range_constexpr(per_lane):
            e = lane + 32 * i
            keys[i] = Int32(RETIRED)
            if e < num_experts:
                keys[i] = _sort_key(Int32(mBits[row, e]))
        for r in cutlass.range_constexpr(top_k):
            # this lane's best: its ids ascend with i, so a tie keeps the lower id
            best_key, best_id = Int32(RETIRED), Int32(num_experts)
            for i in cutlass.range_constexpr(per_lane):
                better = keys[i] > best_key
                best_key = cutlass.select_(better, keys[i], best_key)
                best_id = cutlass.select_(better, lane + 32 * i, best_id)
            for offset in cutlass.range_constexpr(5):
                other_key = cute.arch.shuffle_sync_bfly(best_key, offset=16 >> offset)
                other_id = cute.arch.shuffle_sync_bfly(best_id, offset=16 >> offset)
                better = (other_key > best_key) | ((other_key == best_key) & (other_id < best_id))
                best_key = cutlass.select_(better, other_key, best_key)
                best_id = cutlass.select_(better, other_id, best_id)
            if lane == 0:
                mIds[row, r] = Int64(best_id)
            for i in cutlass.range_constexpr(per_lane):
                keys[i] = cutlass.select_(lane + 32 * i == best_id, Int32(RETIRED), keys[i])


@cute.jit
def topk_ids(mBits: cute.Tensor, mIds: cute.Tensor, num_experts: cutlass.Constexpr, stream):
    grid = (mBits.shape[0] + ROWS_PER_CTA - 1) // ROWS_PER_CTA
    _topk_kernel(mBits, mIds, num_experts).launch(grid=(grid, 1, 1), block=(32 * ROWS_PER_CTA, 1, 1), stream=stream,
                                                  use_pdl=True)
