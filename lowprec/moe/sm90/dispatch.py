"""The MoE dispatch plan in two small CuTe DSL kernels (sm_90a): dropless, or a capacity limit
with the ``"position"`` drop policy (each expert keeps its earliest slots).

The torch form of :func:`lowprec.moe.dispatch` takes ~16 small ops (stable sorts, scatters,
cumsums), ~0.6 ms of host time per call on the H100 machine: more than the E128 layer's grouped
GEMMs. Here the same plan costs two launches. Output is identical to the torch form: kept slots
grouped by expert id ascending, inside an expert by slot number ascending.

Slots are cut into chunks of ``THREADS`` consecutive slots, one CTA (one thread per slot) each:

1. ``_chunk_counts``: per chunk, slots per expert -> ``hist [chunks, E]``.
2. ``_place``: per chunk, from ``hist``: every expert's slots in earlier chunks (the rank of its
   first slot here) and its first packed row (the kept rows, ``min(slots, capacity)``, of lower
   experts); then a slot's rank within its expert = that + the slots of its expert before it in
   the chunk (``match.any`` within the warp, per-warp counts in shared memory across warps). A
   slot is kept if its rank is below the capacity. Chunk 0 also writes the counts and group ends.

No atomics decide an order, so the plan is deterministic. Ids outside ``[0, E)`` (possible only
with ``check_ids=False``, which promises they are not there) are treated as dropped: no row, no
out-of-bounds access.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8

from ...cute.pdl import after_previous_grid
from .config import THREADS

WARPS = THREADS // 32


def _smem_i32(smem, rows: int, cols: int) -> cute.Tensor:
    return smem.allocate_tensor(Int32, cute.make_layout((rows, cols), stride=(cols, 1)), byte_alignment=16)


@cute.jit
def _slot_expert(mIds: cute.Tensor, s, num_experts: cutlass.Constexpr):
    """(expert id as int32, whether slot ``s`` exists and routes to an expert in [0, E))."""
    n = mIds.shape[0]
    e = Int32(mIds[cutlass.min(s, n - 1)])
    valid = (s < n) & (e >= 0) & (e < num_experts)
    return cutlass.select_(valid, e, Int32(-1)), valid


@cute.jit
def _warp_ranks(e):
    """(lanes of the warp before this one with the same ``e``, lanes with the same ``e``)."""
    same = cute.arch.match_sync(0xFFFFFFFF, e)
    return Int32(cute.arch.popc(same & cute.arch.lanemask_lt())), Int32(cute.arch.popc(same))


@cute.jit
def _fill_warp_counts(table: cute.Tensor, tidx, e, valid, num_experts: cutlass.Constexpr):
    """``table[w, x]`` = slots of warp ``w`` routed to expert ``x`` (0 where none); returns the
    thread's rank among its warp's slots of the same expert. Ends with a CTA barrier."""
    for i in cutlass.range_constexpr((WARPS * num_experts + THREADS - 1) // THREADS):
        flat = tidx + i * THREADS
        if flat < WARPS * num_experts:
            table[flat // num_experts, flat % num_experts] = Int32(0)
    rank, count = _warp_ranks(e)
    cute.arch.sync_threads()
    if valid & (rank == 0):
        table[tidx // 32, e] = count
    cute.arch.sync_threads()
    return rank


@cute.kernel
def _chunk_counts_kernel(mIds: cute.Tensor, mHist: cute.Tensor, num_experts: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    after_previous_grid()
    chunk, _, _ = cute.arch.block_idx()
    smem = cutlass.memory.SmemAllocator()
    table = _smem_i32(smem, WARPS, num_experts)
    e, valid = _slot_expert(mIds, chunk * THREADS + tidx, num_experts)
    _fill_warp_counts(table, tidx, e, valid, num_experts)
    if tidx < num_experts:
        total = Int32(0)
        for w in cutlass.range_constexpr(WARPS):
            total += table[w, tidx]
        mHist[chunk, tidx] = total


@cute.kernel
def _place_kernel(mIds: cute.Tensor, mHist: cute.Tensor, mCounts: cute.Tensor, mEnds: cute.Tensor,
                  mRowSlots: cute.Tensor, mSlotRows: cute.Tensor, mKept: cute.Tensor, capacity: Int32,
                  num_experts: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    after_previous_grid()
    chunk, _, _ = cute.arch.block_idx()
    chunks = mHist.shape[0]
    parts = THREADS // num_experts  # threads summing one expert's column of hist
    smem = cutlass.memory.SmemAllocator()
    table = _smem_i32(smem, WARPS, num_experts)
    part_total = _smem_i32(smem, parts, num_experts)
    part_before = _smem_i32(smem, parts, num_experts)
    rank_base = _smem_i32(smem, 1, num_experts)  # slots of the expert in earlier chunks
    first_row = _smem_i32(smem, 1, num_experts)  # the expert's first packed row
    routed = _smem_i32(smem, 1, 1)

    # slots of each expert in all chunks and in the chunks before this one, `parts` threads each
    x, p = tidx % num_experts, tidx // num_experts
    if p < parts:
        total, before = Int32(0), Int32(0)
        for c in range(p, chunks, parts):
            h = mHist[c, x]
            total += h
            before += cutlass.select_(c < chunk, h, Int32(0))
        part_total[p, x] = total
        part_before[p, x] = before
    cute.arch.sync_threads()
    # kept rows per expert (at most `capacity`) and their exclusive scan over experts, by warp 0
    # (each lane E/32 experts)
    if tidx < 32:
        per_lane = (num_experts + 31) // 32
        kept_rows = []
        lane_sum = Int32(0)
        for i in cutlass.range_constexpr(per_lane):
            xe = tidx * per_lane + i
            t = Int32(0)
            if xe < num_experts:
                for q in cutlass.range_constexpr(parts):
                    t += part_total[q, xe]
            t = cutlass.min(t, capacity)
            kept_rows.append(t)
            lane_sum += t
        inclusive = lane_sum
        for d in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(inclusive, 1 << d)
            inclusive += cutlass.select_(tidx >= (1 << d), up, Int32(0))
        start = inclusive - lane_sum
        for i in cutlass.range_constexpr(per_lane):
            xe = tidx * per_lane + i
            if xe < num_experts:
                before = Int32(0)
                for q in cutlass.range_constexpr(parts):
                    before += part_before[q, xe]
                rank_base[0, xe] = before
                first_row[0, xe] = start
                if chunk == 0:
                    mCounts[xe] = kept_rows[i]
                    mEnds[xe] = start + kept_rows[i]
            start += kept_rows[i]
        if tidx == 31:
            routed[0, 0] = inclusive
    cute.arch.sync_threads()

    s = chunk * THREADS + tidx
    e, valid = _slot_expert(mIds, s, num_experts)
    rank = _fill_warp_counts(table, tidx, e, valid, num_experts)
    # per expert, the rank (slot order, all chunks) of each warp's first slot of it
    if tidx < num_experts:
        r = rank_base[0, tidx]
        for w in cutlass.range_constexpr(WARPS):
            count = table[w, tidx]
            table[w, tidx] = r
            r += count
    cute.arch.sync_threads()
    n = mIds.shape[0]
    if s < n:
        row = Int32(-1)
        kept = valid
        if valid:
            rank = table[tidx // 32, e] + rank  # among the expert's slots: the earliest are kept
            kept = rank < capacity
            if kept:
                row = first_row[0, e] + rank
                mRowSlots[row] = Int64(s)
        mSlotRows[s] = Int64(row)
        mKept[s] = cutlass.select_(kept, Uint8(1), Uint8(0))
        # rows past the kept ones are padding
        if s >= routed[0, 0]:
            mRowSlots[s] = Int64(-1)


@cute.jit
def dispatch_plan(mIds: cute.Tensor, mHist: cute.Tensor, mCounts: cute.Tensor, mEnds: cute.Tensor,
                  mRowSlots: cute.Tensor, mSlotRows: cute.Tensor, mKept: cute.Tensor, capacity: Int32,
                  num_experts: cutlass.Constexpr, stream):
    chunks = mHist.shape[0]
    _chunk_counts_kernel(mIds, mHist, num_experts).launch(grid=(chunks, 1, 1), block=(THREADS, 1, 1), stream=stream,
                                                          use_pdl=True)
    _place_kernel(mIds, mHist, mCounts, mEnds, mRowSlots, mSlotRows, mKept, capacity, num_experts).launch(
        grid=(chunks, 1, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True)
