"""The FP8 attention pre-pass kernels (CuTe DSL, sm_90a): K smoothed and quantized, V quantized
and transposed, each one launch that reads its input from HBM once.

Both need a statistic over the whole sequence of a head before they can quantize (K's token mean,
V's channel amax). A cluster of ``cluster`` CTAs (``config.prepass_cluster``: up to 8, chosen by
the launch's size) takes one head: each CTA reduces its 128-token blocks (blocks ``rank``,
``rank + cluster``, ...), writes the partial to a global workspace, and after a cluster barrier
(release / acquire) every CTA combines the ``cluster`` partials in rank order: the same bits in
every CTA and every run of a shape (K's FP32 sum order follows the cluster size, so a head's mean
may differ in its last bit between batch sizes). The second pass re-reads the CTA's blocks,
newest first, from L2 (Nsight Compute, B4 H32 S4096 d128: DRAM reads equal K's bytes).

Every thread streams its own 16-byte chunks of the blocks through a ring of
``config.prepass_ring_stages`` 128-token blocks in shared memory (``cp.async``, ``stages - 1``
blocks ahead of the one it reads, across the two passes): loads stay in flight through the reductions and stores without
holding registers, and a thread reads back only what it copied (no CTA barrier).

- ``k_smooth_quant``: ``k - k_mean`` in FP32 per 128-token block of all D columns (D <= 256: up to
  two 128-column tiles in registers), the block's amax, codes and scale; ``k_mean`` (the FP32
  column sum over the sequence / S) is written too. Dense K of D = 32 and 64 is read as
  rows of ``128 / D`` tokens (``config.prepass_k_fold``), so every lane of a 128-column row has work.
- ``v_quant_t``: per 128 tokens x 128 channels, codes ``v · inv_scale[channel]`` staged transposed
  in shared memory and stored as rows of ``v_t`` (16-byte stores), tokens past Sk as zeros up to
  ``round_up(Sk, 16)``; each channel's scale from its amax over the sequence. The fused attention
  call has it store each 16 tokens in the order the forward kernel reads without shuffles
  (``V_KEY_PERM``).
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
    stage_column,
    store_transposed,
)
from ...cute.pdl import after_previous_grid
from ...cute.utils import LoopInvariant


def _alloc_ring(smem, dtype, stages: int, width: int, rows: int = TILE):
    return smem.allocate_tensor(dtype, cute.make_layout((stages * rows, width), stride=(width, 1)),
                                byte_alignment=128)


@cute.jit
def _row_in_block(rgrp, p, consecutive: cutlass.Constexpr):
    """The block row of a thread's pass ``p``: rows 16 apart (K: coalesced 1x128 chunks per row
    group), or 8 consecutive rows (V: each channel's 8 codes are one 8-byte chunk of Vᵀ)."""
    if cutlass.const_expr(consecutive):
        return rgrp * PASSES + p
    else:
        return rgrp + ROW_GROUPS * p


@cute.jit
def _copy_chunk(atom, src: cute.Tensor, dst: cute.Tensor, src_row, dst_row, col):
    """cp.async of ``src[src_row, col .. col + VEC]`` to ``dst[dst_row, ..]``: 16 bytes a copy."""
    per_copy = 128 // src.element_type.width
    for i in cutlass.range_constexpr(VEC // per_copy):
        c = (col + i * per_copy) // per_copy
        cute.copy(atom, cute.local_tile(src, (1, per_copy), (src_row, c))[0, None],
                  cute.local_tile(dst, (1, per_copy), (dst_row, c))[0, None])


@cute.jit
def _issue_block(atom, mX: cute.Tensor, ring: cute.Tensor, stage, walk, block, seqlen, rgrp, lane,
                 col_tiles: cutlass.Constexpr, d: cutlass.Constexpr, consecutive: cutlass.Constexpr,
                 rows: cutlass.Constexpr = TILE):
    """cp.async of the thread's chunks of 128-token ``block`` (``rows`` rows of ``mX``) of the walk's
    head into ring ``stage`` (rows past ``seqlen`` are not copied: :func:`_read_block` reads them as 0)."""
    for ct in cutlass.range_constexpr(col_tiles):
        col = ct * TILE + lane * VEC
        if col < d:
            for p in cutlass.range_constexpr(rows // ROW_GROUPS):
                row = _row_in_block(rgrp, p, consecutive)
                if block * rows + row < seqlen:
                    _copy_chunk(atom, mX, ring, walk.head_row0 + (block * rows + row) * walk.token_stride,
                                stage * rows + row, col)


@cute.jit
def _read_block(ring: cute.Tensor, stage, block, seqlen, rgrp, lane, ct, d: cutlass.Constexpr,
                consecutive: cutlass.Constexpr, rows: cutlass.Constexpr = TILE):
    """The thread's ``rows / ROW_GROUPS`` x VEC values of column tile ``ct`` of the block in ring
    ``stage`` as FP32 (zeros past ``seqlen`` or D)."""
    col = ct * TILE + lane * VEC
    values = []
    for p in cutlass.range_constexpr(rows // ROW_GROUPS):
        row = _row_in_block(rgrp, p, consecutive)
        frag = cute.make_rmem_tensor((1, VEC), ring.element_type)
        frag.fill(0)
        if col < d and block * rows + row < seqlen:
            cute.autovec_copy(cute.local_tile(ring, (1, VEC), (stage * rows + row, col // VEC)), frag)
        values.append(frag.load().to(Float32))
    return values


class _Walk(LoopInvariant):
    """A CTA's steps over its head: ``2 * per_head`` steps walk the blocks ``rank, rank + cluster,
    ...`` up (the statistics), then down (the quantization; the newest first, still in L2); with
    ``passes=1`` only the quantization, up. Every CTA of the cluster takes the same steps (blocks
    past ``blocks`` are skipped), so all meet at the cluster barrier. Token t of the head is row
    ``head_row0 + t * token_stride`` of the input (packed sequences: ``token_stride`` = heads)."""

    def __init__(self, rank, cluster: int, head_row0, blocks, token_stride=1, passes: int = 2):
        self.rank, self.cluster, self.head_row0, self.blocks = rank, cluster, head_row0, blocks
        self.token_stride, self.passes = token_stride, passes
        self.per_head = (blocks + cluster - 1) // cluster
        self.steps = passes * self.per_head

    def block(self, t):
        if cutlass.const_expr(self.passes == 1):
            return self.rank + self.cluster * t
        return self.rank + self.cluster * cutlass.min(t, self.steps - 1 - t)


@cute.jit
def _issue_step(atom, mX, ring, walk: _Walk, t, seqlen, rgrp, lane, stages: cutlass.Constexpr,
                col_tiles: cutlass.Constexpr, d: cutlass.Constexpr, consecutive: cutlass.Constexpr,
                rows: cutlass.Constexpr = TILE):
    """cp.async of step ``t``'s block into its ring stage, if there is one; one commit group."""
    if t < walk.steps:
        block = walk.block(t)
        if block < walk.blocks:
            _issue_block(atom, mX, ring, t % stages, walk, block, seqlen, rgrp, lane, col_tiles, d, consecutive, rows)
    cute.arch.cp_async_commit_group()


@cute.jit
def _fill_ring(atom, mX, ring, walk: _Walk, seqlen, rgrp, lane, stages: cutlass.Constexpr,
               col_tiles: cutlass.Constexpr, d: cutlass.Constexpr, consecutive: cutlass.Constexpr,
               rows: cutlass.Constexpr = TILE):
    """The ring's first ``stages - 1`` steps."""
    for t in cutlass.range_constexpr(stages - 1):
        _issue_step(atom, mX, ring, walk, t, seqlen, rgrp, lane, stages, col_tiles, d, consecutive, rows)


@cute.jit
def _advance_ring(atom, mX, ring, walk: _Walk, t, seqlen, rgrp, lane, stages: cutlass.Constexpr,
                  col_tiles: cutlass.Constexpr, d: cutlass.Constexpr, consecutive: cutlass.Constexpr,
                  rows: cutlass.Constexpr = TILE):
    """Wait for step ``t``'s block, then refill the stage read at step ``t - 1`` with the block of
    step ``t + stages - 1``. Returns the stage of step ``t``."""
    cute.arch.cp_async_wait_group(stages - 2)
    _issue_step(atom, mX, ring, walk, t + stages - 1, seqlen, rgrp, lane, stages, col_tiles, d, consecutive, rows)
    return t % stages


@cute.jit
def _zero_fragments(col_tiles: cutlass.Constexpr):
    """One zeroed (1, VEC) FP32 fragment per column tile: a thread's running statistic."""
    frags = []
    for _ in cutlass.range_constexpr(col_tiles):
        frag = cute.make_rmem_tensor((1, VEC), Float32)
        frag.fill(0)
        frags.append(frag)
    return frags


def _alloc_row_group_partials(smem, col_tiles: int):
    """One FP32 row of ``col_tiles * 128`` columns per row group: the CTA's partials before the
    row groups are combined."""
    cols = col_tiles * TILE
    return smem.allocate_tensor(Float32, cute.make_layout((ROW_GROUPS, cols), stride=(cols, 1)), byte_alignment=16)


@cute.jit
def _exchange(acc, part_smem: cute.Tensor, mPart: cute.Tensor, head, rank, lane, rgrp, d, col_tiles: cutlass.Constexpr,
              cluster: cutlass.Constexpr, is_max: cutlass.Constexpr):
    """The head's statistic from every thread's ``acc`` (one (1, VEC) FP32 fragment per column tile):
    row groups combined in the CTA (in order), the CTA's partial stored to ``mPart[head * cluster +
    rank]``, a cluster barrier, then the ``cluster`` partials combined in rank order. Returns one
    (1, VEC) fragment per column tile: the thread's columns of the whole head's sum (or max)."""
    for ct in cutlass.range_constexpr(col_tiles):
        cute.autovec_copy(acc[ct], cute.local_tile(part_smem, (1, VEC), (rgrp, ct * LANES + lane)))
    cute.arch.sync_threads()
    if rgrp == 0:
        for ct in cutlass.range_constexpr(col_tiles):
            col = ct * TILE + lane * VEC
            if col < d:
                total = cute.make_rmem_tensor((1, VEC), Float32)
                cute.autovec_copy(cute.local_tile(part_smem, (1, VEC), (0, ct * LANES + lane)), total)
                for r in cutlass.range_constexpr(1, ROW_GROUPS):
                    _combine(total, cute.local_tile(part_smem, (1, VEC), (r, ct * LANES + lane)), is_max)
                cute.autovec_copy(total, cute.local_tile(mPart, (1, VEC), (head * cluster + rank, col // VEC)))
    # barrier.cluster.arrive releases and .wait acquires at cluster scope: the partials every CTA
    # stored are visible to every CTA after it (and the smem partials may be overwritten)
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()
    whole = []
    for ct in cutlass.range_constexpr(col_tiles):
        col = ct * TILE + lane * VEC
        total = cute.make_rmem_tensor((1, VEC), Float32)
        total.fill(0)
        if col < d:
            cute.autovec_copy(cute.local_tile(mPart, (1, VEC), (head * cluster, col // VEC)), total)
            for r in cutlass.range_constexpr(1, cluster):
                _combine(total, cute.local_tile(mPart, (1, VEC), (head * cluster + r, col // VEC)), is_max)
        whole.append(total)
    return whole


@cute.jit
def _fold_lanes(frag: cute.Tensor, d: cutlass.Constexpr, gather: cutlass.Constexpr):
    """Rows of ``fold`` tokens: lane ``l`` of a row's 16 holds channels ``(l % (d / VEC)) * VEC ..``.
    ``gather``: lanes below ``d / VEC`` take the sum over every lane of their channels (butterfly
    over the lanes of the other tokens); else every lane takes lane ``l % (d / VEC)``'s values."""
    owners = d // VEC
    for j in cutlass.range_constexpr(VEC):
        if cutlass.const_expr(gather):
            for i in cutlass.range_constexpr((LANES // owners).bit_length() - 1):
                frag[0, j] = frag[0, j] + cute.arch.shuffle_sync_bfly(frag[0, j], offset=owners << i)
        else:
            lane = cute.arch.lane_idx()
            frag[0, j] = cute.arch.shuffle_sync(frag[0, j], lane - lane % LANES + lane % owners)


@cute.jit
def _combine(total: cute.Tensor, part: cute.Tensor, is_max: cutlass.Constexpr):
    other = cute.make_rmem_tensor((1, VEC), Float32)
    cute.autovec_copy(part, other)
    if cutlass.const_expr(is_max):
        for j in cutlass.range_constexpr(VEC):
            total[0, j] = cute.arch.fmax(total[0, j], other[0, j])
    else:
        total.store(total.load() + other.load())


@cute.jit
def _sequence(mSeq: cute.Tensor, batch, head, heads, out_rows):
    """Packed sequences: (its tokens, first input row, token stride, first output row, statistic
    index) of sequence ``batch``, head ``head`` (``mSeq`` rows: first token, length, first padded
    row; inputs [total·heads, D], outputs [heads·out_rows, D] in the padded layout)."""
    return (mSeq[batch, 1], mSeq[batch, 0] * heads + head, heads, head * out_rows + mSeq[batch, 2],
            batch * heads + head)


@cute.kernel
def _k_smooth_quant_kernel(mK: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor, mMean: cute.Tensor,
                           mPart: cute.Tensor, mSeq: cute.Tensor, seqlen: cutlass.Int32, heads: cutlass.Int32,
                           d: cutlass.Constexpr, stages: cutlass.Constexpr, cluster: cutlass.Constexpr,
                           varlen: cutlass.Constexpr, smooth: cutlass.Constexpr, pdl: cutlass.Constexpr,
                           fold: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    rank, head, batch = cute.arch.block_idx()
    if cutlass.const_expr(pdl):
        after_previous_grid()
    # ``fold`` tokens per row of mK / mQ (dense D < 128: every lane of a 128-column row busy); the
    # statistic stays per channel, ``d`` of them
    width, rows = d * fold, TILE // fold
    d_tiles = (width + TILE - 1) // TILE
    mQ = as_fp8(mQ_u8)
    smem = cutlass.memory.SmemAllocator()
    ring = _alloc_ring(smem, mK.element_type, stages, width, rows)
    warp_max = smem.allocate_tensor(Float32, cute.make_layout(WARPS_PER_CTA), byte_alignment=16)
    part_smem = _alloc_row_group_partials(smem, d_tiles)
    atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), mK.element_type, num_bits_per_copy=128)
    lane, rgrp = tidx % LANES, tidx // LANES
    if cutlass.const_expr(varlen):  # one (sequence, head) per cluster, any length
        seqlen, in_row0, token_stride, out_row0, stat = _sequence(mSeq, batch, head, heads, mQ.shape[0] // heads)
        blocks = (seqlen + TILE - 1) // TILE
    else:
        blocks = seqlen // TILE  # seqlen % 128 == 0
        in_row0, token_stride, out_row0, stat = head * (seqlen // fold), 1, head * (seqlen // fold), head
    row_len = seqlen // fold
    # no statistic (Q): no cluster, the CTAs along x split a head's blocks
    walk = _Walk(rank, cluster if smooth else cute.arch.grid_dim()[0], in_row0, blocks, token_stride,
                 2 if smooth else 1)
    _fill_ring(atom, mK, ring, walk, row_len, rgrp, lane, stages, d_tiles, width, False, rows)
    means = _zero_fragments(d_tiles)
    if cutlass.const_expr(smooth):
        sums = _zero_fragments(d_tiles)
        for t in cutlass.range(walk.per_head):  # the statistics
            stage = _advance_ring(atom, mK, ring, walk, t, row_len, rgrp, lane, stages, d_tiles, width, False, rows)
            block = walk.block(t)
            if block < blocks:
                for ct in cutlass.range_constexpr(d_tiles):
                    tile = _read_block(ring, stage, block, row_len, rgrp, lane, ct, width, False, rows)
                    for p in cutlass.range_constexpr(rows // ROW_GROUPS):
                        sums[ct].store(sums[ct].load() + tile[p])
        if cutlass.const_expr(fold > 1):  # lanes 0 .. d / VEC - 1 take their channels' sums of the row
            _fold_lanes(sums[0], d, True)
        totals = _exchange(sums, part_smem, mPart, stat, rank, lane, rgrp, d, d_tiles, cluster, False)
        if cutlass.const_expr(fold > 1):  # ... and give the head's sums back to the lanes of the other tokens
            _fold_lanes(totals[0], d, False)
        count = Float32(seqlen)
        if cutlass.const_expr(varlen):  # an empty sequence's mean is 0
            count = Float32(cutlass.max(seqlen, 1))
        for ct in cutlass.range_constexpr(d_tiles):
            means[ct].store(totals[ct].load() / count)
            if rank == 0 and rgrp == 0 and ct * TILE + lane * VEC < d:
                cute.autovec_copy(means[ct], cute.local_tile(mMean, (1, VEC), (stat, (ct * TILE + lane * VEC) // VEC)))
    for t in cutlass.range(walk.steps - walk.per_head, walk.steps):  # the quantization
        stage = _advance_ring(atom, mK, ring, walk, t, row_len, rgrp, lane, stages, d_tiles, width, False, rows)
        block = walk.block(t)
        if block < blocks:  # the same branch for the whole CTA
            values = []
            amax = Float32(0.0)
            for ct in cutlass.range_constexpr(d_tiles):
                tile = _read_block(ring, stage, block, row_len, rgrp, lane, ct, width, False, rows)
                for p in cutlass.range_constexpr(rows // ROW_GROUPS):
                    tile[p] = tile[p] - means[ct].load()  # columns past D: 0 - 0
                    if cutlass.const_expr(varlen and smooth):  # tokens past the sequence stay 0
                        row = block * TILE + _row_in_block(rgrp, p, False)
                        frag = cute.make_rmem_tensor((1, VEC), Float32)
                        frag.store(tile[p])
                        for j in cutlass.range_constexpr(VEC):
                            frag[0, j] = cutlass.select_(row < seqlen, frag[0, j], Float32(0.0))
                        tile[p] = frag.load()
                    amax = cute.arch.fmax(amax, abs(tile[p]).reduce(cute.ReductionOp.MAX, Float32(0.0), 0))
                values.append(tile)
            amax = cta_max(amax, warp_max, tidx)
            scale, inv = scale_and_inverse(amax)
            row0 = out_row0 + block * rows
            for ct in cutlass.range_constexpr(d_tiles):
                out_col = ct * TILE + lane * VEC
                if out_col < width:
                    for p in cutlass.range_constexpr(rows // ROW_GROUPS):
                        store_row_chunk(mQ, values[ct][p] * inv, row0 + rgrp + ROW_GROUPS * p, out_col)
            if tidx == 0:
                mS[out_row0 // rows + block, 0] = scale
            cute.arch.sync_threads()  # warp_max is rewritten by the next block


@cute.jit
def k_smooth_quant(mK: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor, mMean: cute.Tensor, mPart: cute.Tensor,
                   seqlen: cutlass.Int32, heads: cutlass.Int32, d: cutlass.Constexpr, stages: cutlass.Constexpr,
                   cluster: cutlass.Constexpr, pdl: cutlass.Constexpr, fold: cutlass.Constexpr, stream):
    """``mK`` [heads·S/fold, fold·D] (S % 128 == 0; ``fold`` tokens per row, ``config.prepass_k_fold``)
    -> codes of the same shape of K minus its token mean, scales [heads·S/128, 1], ``mMean`` [heads,
    D] FP32; ``mPart`` [heads·cluster, D] FP32 workspace; ``stages``: ``config.prepass_ring_stages``;
    ``cluster`` CTAs per head; ``pdl``: programmatic dependent launch."""
    _k_smooth_quant_kernel(mK, mQ_u8, mS, mMean, mPart, mS, seqlen, heads, d, stages, cluster, False, True,
                           pdl, fold).launch(grid=(cluster, heads, 1), block=(THREADS, 1, 1), cluster=(cluster, 1, 1),
                                       stream=stream, use_pdl=pdl)


@cute.jit
def packed_quant(mX: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor, mMean: cute.Tensor, mPart: cute.Tensor,
                 mSeq: cute.Tensor, heads: cutlass.Int32, ctas: cutlass.Int32, d: cutlass.Constexpr,
                 stages: cutlass.Constexpr, cluster: cutlass.Constexpr, smooth: cutlass.Constexpr,
                 pdl: cutlass.Constexpr, stream):
    """Packed sequences (``lowprec.attention.packed``'s padded layout): ``mX`` [total·heads, D] (token
    t of head h at row t·heads + h) -> codes [heads·R, D] (sequence b from padded row ``mSeq[b, 2]``,
    tokens past its length 0), scales [heads·R/128, 1]; with ``smooth`` each sequence's token mean
    is subtracted first and written to ``mMean`` [B·heads, D] (else Q: plain 128-token blocks).
    ``mSeq`` [B, 4] int32: first token, length, first padded row. One cluster per (sequence, head)
    with ``smooth``; else ``ctas`` CTAs (no cluster)."""
    _k_smooth_quant_kernel(mX, mQ_u8, mS, mMean, mPart, mSeq, cutlass.Int32(0), heads, d, stages, cluster, True,
                           smooth, pdl, 1).launch(grid=(cluster if smooth else ctas, heads, mSeq.shape[0]),
                                               block=(THREADS, 1, 1), cluster=(cluster if smooth else 1, 1, 1),
                                               stream=stream, use_pdl=pdl)


@cute.kernel
def _v_quant_t_kernel(mV: cute.Tensor, mVt_u8: cute.Tensor, mScale: cute.Tensor, mPart: cute.Tensor,
                      mSeq: cute.Tensor, seqlen: cutlass.Int32, heads: cutlass.Int32, d: cutlass.Constexpr,
                      stages: cutlass.Constexpr, cluster: cutlass.Constexpr, permute_keys: cutlass.Constexpr,
                      varlen: cutlass.Constexpr, pdl: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    rank, head, batch = cute.arch.block_idx()
    if cutlass.const_expr(pdl):
        after_previous_grid()
    col_tiles = (d + TILE - 1) // TILE
    smem = cutlass.memory.SmemAllocator()
    ring = _alloc_ring(smem, mV.element_type, stages, d)
    tile_t = alloc_transposed_tile(smem)
    part_smem = _alloc_row_group_partials(smem, col_tiles)
    atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), mV.element_type, num_bits_per_copy=128)
    mVt = as_fp8(mVt_u8)
    lane, rgrp = tidx % LANES, tidx // LANES
    if cutlass.const_expr(varlen):  # keys of sequence b from column mSeq[b, 2], zeros to its 128-token end
        seqlen, in_row0, token_stride, _, stat = _sequence(mSeq, batch, head, heads, 0)
        blocks = (seqlen + TILE - 1) // TILE
        col0 = mSeq[batch, 2]
        col_end = col0 + blocks * TILE
    else:
        blocks = (mVt.shape[1] + TILE - 1) // TILE
        in_row0, token_stride, stat, col0, col_end = head * seqlen, 1, head, 0, mVt.shape[1]
    walk = _Walk(rank, cluster, in_row0, blocks, token_stride)
    amaxes = _zero_fragments(col_tiles)
    _fill_ring(atom, mV, ring, walk, seqlen, rgrp, lane, stages, col_tiles, d, True)
    for t in cutlass.range(walk.per_head):  # the statistics
        stage = _advance_ring(atom, mV, ring, walk, t, seqlen, rgrp, lane, stages, col_tiles, d, True)
        block = walk.block(t)
        if block < walk.blocks:
            for ct in cutlass.range_constexpr(col_tiles):
                values = _read_block(ring, stage, block, seqlen, rgrp, lane, ct, d, True)
                for p in cutlass.range_constexpr(PASSES):
                    for j in cutlass.range_constexpr(VEC):
                        amaxes[ct][0, j] = cute.arch.fmax(amaxes[ct][0, j], abs(values[p][j]))
    amax = _exchange(amaxes, part_smem, mPart, stat, rank, lane, rgrp, d, col_tiles, cluster, True)
    invs = []
    for ct in cutlass.range_constexpr(col_tiles):
        col = ct * TILE + lane * VEC
        inv = cute.make_rmem_tensor((1, VEC), Float32)
        for j in cutlass.range_constexpr(VEC):
            scale, inv_j = scale_and_inverse(amax[ct][0, j])
            inv[0, j] = inv_j
            if rank == 0 and rgrp == 0 and col < d:  # one writer per channel
                mScale[stat, col + j] = scale
        invs.append(inv)
    for t in cutlass.range(walk.per_head, walk.steps):  # the quantization
        stage = _advance_ring(atom, mV, ring, walk, t, seqlen, rgrp, lane, stages, col_tiles, d, True)
        block = walk.block(t)
        if block < walk.blocks:  # the same branch for the whole CTA
            for ct in cutlass.range_constexpr(col_tiles):
                values = _read_block(ring, stage, block, seqlen, rgrp, lane, ct, d, True)
                for j in cutlass.range_constexpr(VEC):
                    stage_column(tile_t, column_codes(values, j, invs[ct][0, j]), lane, rgrp, j)
                cute.arch.sync_threads()
                store_transposed(tile_t, mVt, head * d + ct * TILE, head * d + d, col0 + block * TILE, col_end, tidx,
                                 permute_keys)
                cute.arch.sync_threads()  # tile_t is restaged next


@cute.jit
def v_quant_t(mV: cute.Tensor, mVt_u8: cute.Tensor, mScale: cute.Tensor, mPart: cute.Tensor, seqlen: cutlass.Int32,
              heads: cutlass.Int32, d: cutlass.Constexpr, stages: cutlass.Constexpr, cluster: cutlass.Constexpr,
              permute_keys: cutlass.Constexpr, pdl: cutlass.Constexpr, stream):
    """``mV`` [heads·S, D] -> ``v_t`` codes [heads·D, S_pad] (S_pad = round_up(S, 16); the padding
    tokens as zeros; with ``permute_keys`` the tokens of each aligned 16 stored in
    ``config.V_KEY_PERM`` order) and ``mScale`` [heads, D] FP32 (the quantizer's scale of each
    channel's amax over the sequence); ``mPart`` [heads·cluster, D] FP32 workspace; ``stages``:
    ``config.prepass_ring_stages``; ``cluster`` CTAs per head."""
    _v_quant_t_kernel(mV, mVt_u8, mScale, mPart, mScale, seqlen, heads, d, stages, cluster, permute_keys,
                      False, pdl).launch(grid=(cluster, heads, 1), block=(THREADS, 1, 1), cluster=(cluster, 1, 1),
                                         stream=stream, use_pdl=pdl)


@cute.jit
def packed_v_quant_t(mV: cute.Tensor, mVt_u8: cute.Tensor, mScale: cute.Tensor, mPart: cute.Tensor,
                     mSeq: cute.Tensor, heads: cutlass.Int32, d: cutlass.Constexpr, stages: cutlass.Constexpr,
                     cluster: cutlass.Constexpr, permute_keys: cutlass.Constexpr, pdl: cutlass.Constexpr, stream):
    """Packed sequences: ``mV`` [total·heads, D] -> ``v_t`` codes [heads·D, R] (sequence b's keys from
    column ``mSeq[b, 2]``, zeros to its padded end), ``mScale`` [B·heads, D] (each sequence's channel
    scales); as :func:`packed_quant` otherwise."""
    _v_quant_t_kernel(mV, mVt_u8, mScale, mPart, mSeq, cutlass.Int32(0), heads, d, stages, cluster, permute_keys,
                      True, pdl).launch(grid=(cluster, heads, mSeq.shape[0]), block=(THREADS, 1, 1),
                                        cluster=(cluster, 1, 1), stream=stream, use_pdl=pdl)
