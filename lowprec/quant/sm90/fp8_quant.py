"""FP8 E4M3 quantize kernels (CuTe DSL), bit-identical to the reference quantizer.

- ``quant_1x128``: each thread handles 8 contiguous elements (16 bytes of bf16), 16 threads cover
  one 128-wide block and reduce its amax with warp shuffles; a tile is one column block of 64
  rows (its scales are contiguous in the MN-major layout); persistent CTAs copy the next tile
  into shared memory (cp.async) while quantizing the current one.
- ``quant_rowwise``: one CTA per row, amax sweep then quantize sweep (the second from L2);
  ``quant_rowwise_staged`` for long rows reads up to 16384 columns once, into shared memory.
- ``quant_128x128``: one CTA per 128x128 weight tile, held in registers (read once).
- ``quant_dual``: 128x128 tiles, both orientations (1x128 along features for the forward GEMM,
  1x128 along tokens, transposed through shared memory, for the weight gradient); persistent
  CTAs, two input stages (the next tile copied with cp.async while the current one is
  quantized), scales computed once per warp.
- ``quant_t_gathered``: the token-major half of ``quant_dual`` of rows gathered through a row map
  (zeros where the map is -1): the MoE layer's K-grouped weight-gradient operands.

All multiply by ``1 / scale`` (one IEEE division per block, as the reference) and convert with
``cvt.rn.satfinite`` (the block pieces: :mod:`lowprec.cute.fp8_block`). Scales go straight into
the layout the GEMM reads (any strides). The MoE's fused kernels (pack, SwiGLU) are in
:mod:`lowprec.moe.sm90`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ...cute.fp8_block import (
    BLOCK,
    GROUPS_PER_CTA,
    LANES,
    ROWS_PER_CTA,
    THREADS,
    UNROLL,
    VEC,
    WARPS_PER_CTA,
    as_fp8,
    grid_1x128,
    scale_and_inverse,
    store_row_chunk,
)
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
from ...cute.pdl import after_previous_grid

# ...) and each thread copies its own 16-byte chunks of the tiles PREFETCH ahead global -> shared
# with cp.async (LDGSTS: no register holds the bytes in flight), then reads back the chunks of the
# tile it quantizes. A thread reads only what it copied itself: no CTA barrier guards the slots.
# Register loads kept bytes in flight only while a short-lived CTA loaded (NOTES v4).
CHUNK_BYTES = 16


def _alloc_slots(smem, dtype, chunks: int, stages: int):
    """[VEC, THREADS, chunks, stages] elements: a thread's VEC elements contiguous, threads next to
    each other (16-byte accesses of a quarter-warp cover 128 contiguous bytes: conflict-free)."""
    return smem.allocate_tensor(dtype, cute.make_layout((VEC, THREADS, chunks, stages)), byte_alignment=128)


@cute.jit
def _prefetch_chunk(mX: cute.Tensor, slots: cute.Tensor, tidx, chunk, stage, row, col, in_bounds):
    """cp.async of ``mX[row, col .. col + VEC]`` into the thread's slot (zeros when out of bounds)."""
    dst = slots[(None, tidx, chunk, stage)]
    if in_bounds:
        per_copy = CHUNK_BYTES * 8 // mX.element_type.width
        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), mX.element_type, num_bits_per_copy=CHUNK_BYTES * 8)
        src = cute.local_tile(mX, (1, VEC), (row, col // VEC))
        for h in cutlass.range_constexpr(VEC // per_copy):
            cute.copy(atom, cute.local_tile(src[0, None], (per_copy,), (h,)), cute.local_tile(dst, (per_copy,), (h,)))
    else:
        zeros = cute.make_rmem_tensor((VEC,), mX.element_type)
        zeros.fill(0)
        cute.autovec_copy(zeros, dst)


@cute.jit
def _read_chunk(slots: cute.Tensor, tidx, chunk, stage):
    frag = cute.make_rmem_tensor((VEC,), slots.element_type)
    cute.autovec_copy(slots[(None, tidx, chunk, stage)], frag)
    return frag.load().to(Float32)


# One tile ahead: 32 KB of bf16 slots and 34 registers, so 6 CTAs per SM (48 warps). Measured
# (NOTES v4): 88-91% of copy, against 81-84% two tiles ahead at 4 CTAs per SM.
PREFETCH_1X128 = 1
STAGES_1X128 = PREFETCH_1X128 + 1


@cute.jit
def _tile_1x128(tile, blocks_per_row, tidx, u):
    """(row, block column, first column) of the thread's block ``u`` in 1x128 tile ``tile``."""
    row_tile = tile // blocks_per_row
    kb = tile - row_tile * blocks_per_row
    row = row_tile * ROWS_PER_CTA + u * GROUPS_PER_CTA + tidx // LANES
    return row, kb, kb * BLOCK + (tidx % LANES) * VEC


@cute.jit
def _prefetch_1x128(mX: cute.Tensor, slots: cute.Tensor, tidx, tile, n_tiles, blocks_per_row, stage):
    if tile < n_tiles:
        for u in cutlass.range_constexpr(UNROLL):
            row, kb, col = _tile_1x128(tile, blocks_per_row, tidx, u)
            _prefetch_chunk(mX, slots, tidx, u, stage, row, col, row < mX.shape[0] and col < mX.shape[1])
    cute.arch.cp_async_commit_group()


@cute.kernel
def _quant_1x128_kernel(mX: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    after_previous_grid()
    bidx, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    rows = mX.shape[0]
    cols = mX.shape[1]
    blocks_per_row = mS.shape[1]
    n_tiles = grid_1x128(rows, blocks_per_row)
    mQ = as_fp8(mQ_u8)
    smem = cutlass.memory.SmemAllocator()
    slots = _alloc_slots(smem, mX.element_type, UNROLL, STAGES_1X128)

    lane = tidx % LANES
    for p in cutlass.range_constexpr(PREFETCH_1X128):
        _prefetch_1x128(mX, slots, tidx, bidx + p * grid, n_tiles, blocks_per_row, p)
    for i in range((n_tiles - bidx + grid - 1) // grid):
        tile = bidx + i * grid
        _prefetch_1x128(mX, slots, tidx, tile + PREFETCH_1X128 * grid, n_tiles, blocks_per_row,
                        (i + PREFETCH_1X128) % STAGES_1X128)
        cute.arch.cp_async_wait_group(PREFETCH_1X128)
        stage = i % STAGES_1X128
        for u in cutlass.range_constexpr(UNROLL):
            row, kb, col = _tile_1x128(tile, blocks_per_row, tidx, u)
            values = _read_chunk(slots, tidx, u, stage)
            # every lane joins the shuffle, in bounds or not
            amax = abs(values).reduce(cute.ReductionOp.MAX, Float32(0.0), 0)
            amax = cute.arch.warp_reduction_max(amax, threads_in_group=LANES)
            scale, inv = scale_and_inverse(amax)
            if row < rows and col < cols:
                store_row_chunk(mQ, values * inv, row, col)
                if lane == 0:
                    mS[row, kb] = scale


@cute.jit
def quant_1x128(mX: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor, max_ctas: cutlass.Int32, stream):
    """``max_ctas``: the CTAs resident at once on the device (the grid of the persistent walk)."""
    grid = cutlass.min(grid_1x128(mX.shape[0], mS.shape[1]), max_ctas)
    _quant_1x128_kernel(mX, mQ_u8, mS).launch(
        grid=(grid, 1, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True)


# ---------------------------------------------------------------------------------------------
# Rowwise: one CTA per row, two sweeps over it (amax, then quantize); the second sweep reads from
# L2 (at most ~8 rows per SM are in flight, far below L2's size).
CHUNK = THREADS * VEC


# Rows longer than ROWWISE_SHORT_COLS are staged in shared memory: the thread's first
# ROWWISE_STAGED chunks (up to 16384 columns) are copied with cp.async, all in flight at once, and
# both sweeps read them from there; chunks past those are read from global memory by both sweeps
# (the second from L2). Short rows keep the plain two sweeps: 32 registers and no shared memory
# let 8 CTAs (64 warps) per SM stream them at ~99% of copy (NOTES v4).
ROWWISE_SHORT_COLS = 4096
ROWWISE_STAGED = 8  # 32 KB of bf16 slots: 6 CTAs per SM


@cute.kernel
def _quant_rowwise_kernel(mX: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor, staged: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    after_previous_grid()
    row, _, _ = cute.arch.block_idx()
    cols = mX.shape[1]
    mQ = as_fp8(mQ_u8)
    smem = cutlass.memory.SmemAllocator()
    warp_max = smem.allocate_tensor(Float32, cute.make_layout(WARPS_PER_CTA), byte_alignment=16)

    chunks = (cols + CHUNK - 1) // CHUNK
    amax = Float32(0.0)
    if cutlass.const_expr(staged > 0):
        slots = _alloc_slots(smem, mX.element_type, staged, 1)
        for c in cutlass.range_constexpr(staged):
            staged_col = c * CHUNK + tidx * VEC
            if c < chunks:
                _prefetch_chunk(mX, slots, tidx, c, 0, row, staged_col, staged_col < cols)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        for c in cutlass.range_constexpr(staged):
            if c < chunks:
                amax = cute.arch.fmax(amax, abs(_read_chunk(slots, tidx, c, 0)).reduce(cute.ReductionOp.MAX,
                                                                                      Float32(0.0), 0))
    for i in cutlass.range(staged, chunks):
        col = i * CHUNK + tidx * VEC
        frag = cute.make_rmem_tensor((1, VEC), mX.element_type)
        frag.fill(0)
        if col < cols:
            cute.autovec_copy(cute.local_tile(mX, (1, VEC), (row, col // VEC)), frag)
        amax = cute.arch.fmax(amax, abs(frag.load().to(Float32)).reduce(cute.ReductionOp.MAX, Float32(0.0), 0))
    amax = cta_max(amax, warp_max, tidx)
    scale, inv = scale_and_inverse(amax)
    if cutlass.const_expr(staged > 0):
        for c in cutlass.range_constexpr(staged):
            staged_col = c * CHUNK + tidx * VEC
            if c < chunks and staged_col < cols:
                store_row_chunk(mQ, _read_chunk(slots, tidx, c, 0) * inv, row, staged_col)
    for i in cutlass.range(staged, chunks):
        col = i * CHUNK + tidx * VEC
        if col < cols:
            frag = cute.make_rmem_tensor((1, VEC), mX.element_type)
            cute.autovec_copy(cute.local_tile(mX, (1, VEC), (row, col // VEC)), frag)
            store_row_chunk(mQ, frag.load().to(Float32) * inv, row, col)
    if tidx == 0:
        mS[row, 0] = scale


@cute.jit
def quant_rowwise(mX: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor, stream):
    """Rows of at most ``ROWWISE_SHORT_COLS`` columns (longer rows: ``quant_rowwise_staged``)."""
    _quant_rowwise_kernel(mX, mQ_u8, mS, 0).launch(
        grid=(mX.shape[0], 1, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True)


@cute.jit
def quant_rowwise_staged(mX: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor, stream):
    _quant_rowwise_kernel(mX, mQ_u8, mS, ROWWISE_STAGED).launch(
        grid=(mX.shape[0], 1, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True)


@cute.kernel
def _quant_128x128_kernel(mX: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor, mQT_u8: cute.Tensor,
                          with_t: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    after_previous_grid()
    tile_r, tile_c, _ = cute.arch.block_idx()
    mQ = as_fp8(mQ_u8)
    smem = cutlass.memory.SmemAllocator()
    warp_max = smem.allocate_tensor(Float32, cute.make_layout(WARPS_PER_CTA), byte_alignment=16)

    lane, rgrp = tidx % LANES, tidx // LANES
    row0, col = tile_r * TILE, tile_c * TILE + lane * VEC
    first_row, row_step = row0 + rgrp, ROW_GROUPS
    if cutlass.const_expr(with_t):
        # 8 consecutive rows per thread: each of its columns' 8 codes is one 8-byte chunk of the
        # transposed tile (as in the dual kernel)
        first_row, row_step = row0 + rgrp * PASSES, 1
    values = load_tile(mX, first_row, row_step, col)
    amax = Float32(0.0)
    for p in cutlass.range_constexpr(PASSES):
        amax = cute.arch.fmax(amax, abs(values[p]).reduce(cute.ReductionOp.MAX, Float32(0.0), 0))
    amax = cta_max(amax, warp_max, tidx)
    scale, inv = scale_and_inverse(amax)
    for p in cutlass.range_constexpr(PASSES):
        r = first_row + row_step * p
        if r < mX.shape[0] and col < mX.shape[1]:
            store_row_chunk(mQ, values[p] * inv, r, col)
    if tidx == 0:
        mS[tile_r, tile_c] = scale
    if cutlass.const_expr(with_t):
        # mX stacks E matrices of N = mQT.shape[1] rows (N % 128 == 0 when E > 1); mQT stacks their
        # transposes, [E * K, N]. The codes are the same: a 128x128 block's scale does not depend on
        # the orientation.
        tile_t = alloc_transposed_tile(smem)
        mQT = as_fp8(mQT_u8)
        for j in cutlass.range_constexpr(VEC):
            stage_column(tile_t, column_codes(values, j, inv), lane, rgrp, j)
        cute.arch.sync_threads()
        n = mQT.shape[1]
        k = mX.shape[1]
        e = row0 // n
        store_transposed(tile_t, mQT, e * k + tile_c * TILE, e * k + k, row0 - e * n, n, tidx)


@cute.jit
def quant_128x128(mX: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor, stream):
    _quant_128x128_kernel(mX, mQ_u8, mS, mQ_u8, False).launch(
        grid=(mS.shape[0], mS.shape[1], 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True)


@cute.jit
def quant_128x128_t(mX: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor, mQT_u8: cute.Tensor, stream):
    """``quant_128x128`` that also writes the transposed codes (``mQT_u8`` [E * K, N], see kernel)."""
    _quant_128x128_kernel(mX, mQ_u8, mS, mQT_u8, True).launch(
        grid=(mS.shape[0], mS.shape[1], 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True)


@cute.jit
def _quantize_columns(values, col_max: cute.Tensor, tile_t: cute.Tensor, mQT: cute.Tensor, mST: cute.Tensor,
                      tile_r, tile_c, cols, row0, tidx):
    """1x128 along tokens of the CTA's 128x128 tile (``values``: the thread's 8x8 micro-tile,
    rows (t // 16) * 8 ..): codes of column c to ``mQT[tile_c·128 + c, row0 ..]``, scales to
    ``mST[tile_c·128 + c, tile_r]``, through the swizzled transposed tile."""
    lane, rgrp = tidx % LANES, tidx // LANES
    # amax over the tile's 128 tokens (8 per thread, 2 row groups per warp, 8 warps)
    for j in cutlass.range_constexpr(VEC):
        cmax = Float32(0.0)
        for p in cutlass.range_constexpr(PASSES):
            cmax = cute.arch.fmax(cmax, abs(values[p][j]))
        cmax = cute.arch.fmax(cmax, cute.arch.shuffle_sync_bfly(cmax, offset=16))
        if tidx % 32 < LANES:
            col_max[tidx // 32, j, lane] = cmax
    cute.arch.sync_threads()
    for j in cutlass.range_constexpr(VEC):
        c = lane * VEC + j
        cmax = col_max[0, j, lane]
        for w in cutlass.range_constexpr(1, WARPS_PER_CTA):
            cmax = cute.arch.fmax(cmax, col_max[w, j, lane])
        scale, inv = scale_and_inverse(cmax)
        stage_column(tile_t, column_codes(values, j, inv), lane, rgrp, j)
        if rgrp == 0 and tile_c * TILE + c < cols:
            mST[tile_c * TILE + c, tile_r] = scale
    cute.arch.sync_threads()

    store_transposed(tile_t, mQT, tile_c * TILE, cols, row0, mQT.shape[1], tidx)


def _alloc_col_max(smem):
    """Per-warp column amax [warp, j, lane] of column lane * VEC + j: a half-warp touches 16
    consecutive words (no bank conflicts)."""
    return smem.allocate_tensor(Float32, cute.make_layout((WARPS_PER_CTA, VEC, LANES),
                                                          stride=(VEC * LANES, LANES, 1)), byte_alignment=16)


# ---------------------------------------------------------------------------------------------
# Both orientations in one pass (training activations): Q = quant_1x128(X) for the forward GEMM
# and QT = quant_1x128(Xᵀ) (128-row blocks along tokens) for the weight-gradient GEMM. Thread t
# holds an 8x8 micro-tile of the CTA's 128x128 tile (rows (t // 16) * 8 .. + 8, columns
# (t % 16) * 8 .. + 8): each row chunk is 8 bytes of Q, stored from registers; each column's 8
# tokens are one 8-byte chunk of the swizzled transposed tile, stored to QT in 16-byte chunks.
# Per-thread work is kept small, because inside a training step the kernel runs next to GEMMs
# that hold the chip at its power cap, and the SM clock then sets its speed (NOTES, sessions 10-11:
# ~17 instructions per element instead of ~28, 8-20% faster after a GEMM, 1-2 points of copy
# bandwidth slower on a cool chip). Each row's and each column's scale is computed once per warp
# (a reduce-scatter of the maxima, one scale per lane, shuffled back). The warps' column maxima
# meet in a double-buffered shared array, so no barrier is needed before the next tile reuses it.
# Each thread copies its own chunks of the next tile (cp.async) into the other stage before
# quantizing the current one.

# Row tiles per band of the dual kernel's tile walk. Measured (NOTES, session 10), % of copy at
# 16384x4096: column-major walk 79.8, bands of 2 / 4 / 8 / 16 / 32: 82.3 / 82.1 / 82.5 / 82.0 / 81.2.
DUAL_GROUP_R = 4


@cute.jit
def _dual_tile_coords(tile, tiles_r, tiles_c):
    """(row tile, column tile) of walk index ``tile``: bands of DUAL_GROUP_R row tiles, each band
    walked row tile fastest, then column tile. The CTAs running at once cover ~66 column tiles
    of 4 row tiles, so each row of Q and of Qᵀ is written in runs of 128-byte segments instead of
    one segment (Q) per row and tile."""
    band = tile // (DUAL_GROUP_R * tiles_c)
    first_r = band * DUAL_GROUP_R
    rows_in_band = cutlass.min(DUAL_GROUP_R, tiles_r - first_r)
    local = tile - band * (DUAL_GROUP_R * tiles_c)
    tile_c = local // rows_in_band
    return first_r + (local - tile_c * rows_in_band), tile_c


@cute.jit
def _prefetch_dual(mXs: list, slots: list, tidx, tile, n_tiles, tiles_r, tiles_c, stage):
    if tile < n_tiles:
        tile_r, tile_c = _dual_tile_coords(tile, tiles_r, tiles_c)
        col = tile_c * TILE + (tidx % LANES) * VEC
        first_row = tile_r * TILE + (tidx // LANES) * PASSES
        for mX, sl in zip(mXs, slots):
            for p in cutlass.range_constexpr(PASSES):
                _prefetch_chunk(mX, sl, tidx, p, stage, first_row + p, col,
                                first_row + p < mX.shape[0] and col < mX.shape[1])
    cute.arch.cp_async_commit_group()


# What the dual kernel quantizes, from its inputs' chunks in FP32: the input itself, or the dense
# SwiGLU MLP's activation silu(g) · u and its gradients (inputs g, u, da / g, da; torch's formulas,
# silu_backward's ((dy · sigmoid) · fma(g, 1 - sigmoid, 1)) as nvcc contracts it). The sigmoid is
# MUFU's ex2 and rcp (a few ulp from torch's expf and IEEE division, far inside E4M3's step):
# 17-21% faster than the exact forms on the H100, where those made the kernels issue-bound (NOTES).
DUAL_OPS = {"copy": 1, "swiglu": 2, "swiglu_dgate": 3, "swiglu_dup": 2}


@cute.jit
def _sigmoid_fast(g):
    """1 / (1 + e^-g) by MUFU.EX2 and MUFU.RCP (a few ulp; the result is quantized to E4M3)."""
    out = cute.make_rmem_tensor(g.shape, Float32)
    out.store(g)
    for i in cutlass.range_constexpr(cute.size(out)):
        out[i] = cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-out[i], fastmath=True))
    return out.load()


@cute.jit
def _dual_op(op: cutlass.Constexpr, xs: list):
    if cutlass.const_expr(op == "copy"):
        return xs[0]
    g = xs[0]
    sig = _sigmoid_fast(g)
    if cutlass.const_expr(op == "swiglu"):
        return (g * sig) * xs[1]
    if cutlass.const_expr(op == "swiglu_dup"):
        return xs[1] * (g * sig)
    one = cute.full_like(g, 1.0)
    return ((xs[2] * xs[1]) * sig) * cute.math.fma(g, one - sig, one)


@cute.jit
def _row_max_scattered(row_max, lane16):
    """Reduce-scatter over the 16 lanes of a row group of their 8 row maxima: lane l ends with
    the group's maximum of row (l // 2) % 8 (8 shuffles instead of 8 x 4)."""
    hi = (lane16 & 8) != 0
    k1 = [cute.arch.fmax(cutlass.select_(hi, row_max[i + 4], row_max[i]),
                         cute.arch.shuffle_sync_bfly(cutlass.select_(hi, row_max[i], row_max[i + 4]), offset=8))
          for i in range(4)]  # row i + 4·hi
    hi = (lane16 & 4) != 0
    k2 = [cute.arch.fmax(cutlass.select_(hi, k1[i + 2], k1[i]),
                         cute.arch.shuffle_sync_bfly(cutlass.select_(hi, k1[i], k1[i + 2]), offset=4))
          for i in range(2)]  # row i + 2·(lane bit 2) + 4·(lane bit 3)
    hi = (lane16 & 2) != 0
    k3 = cute.arch.fmax(cutlass.select_(hi, k2[1], k2[0]),
                        cute.arch.shuffle_sync_bfly(cutlass.select_(hi, k2[0], k2[1]), offset=2))
    return cute.arch.fmax(k3, cute.arch.shuffle_sync_bfly(k3, offset=1))


def _alloc_col_partials(smem):
    """Column maxima of each warp's 16 tokens, [parity, warp, column], two tiles' worth."""
    layout = cute.make_layout((2, WARPS_PER_CTA, TILE), stride=(WARPS_PER_CTA * TILE, TILE, 1))
    return smem.allocate_tensor(Float32, layout, byte_alignment=16)


@cute.jit
def _dual_tile(slots: list, stage, mQ: cute.Tensor, mS: cute.Tensor, mQT: cute.Tensor, mST: cute.Tensor,
               col_part: cute.Tensor, tile_t: cute.Tensor, tile_r, tile_c, tidx, op: cutlass.Constexpr,
               t_rows: cutlass.Constexpr):
    """Both quantizations of one 128x128 tile of ``op`` of the inputs, the thread's 8x8 micro-tile
    in ``slots`` stage ``stage``; stores past the outputs' ends are skipped. ``copy``: the micro-
    tile is read into registers for the rows and read again, half at a time, for the columns
    (after the CTA barrier, so those reads cannot be merged with the first): 64 values are never
    live next to the columns' work (2 CTAs per SM without spills). The SwiGLU ops keep their 64
    values (one CTA per SM). Qᵀ goes through ``tile_t`` (a second barrier), so that
    it leaves in 16-byte chunks, 8 lanes per 128-byte row: stored from registers, 8 bytes to 16
    rows per warp instruction, it ran 12 points of copy bandwidth slower (NOTES, session 10). ``t_rows``: Qᵀ's
    scale blocks span that many of its rows (x's columns): 1 (one scale per column, ``mST[col, tile_r]``), 16
    (``mST[col // 16, tile_r]``) or 128 (one per tile, ``mST[tile_c, tile_r]``)."""
    rows, cols, t_pad = mQ.shape[0], mQ.shape[1], mQT.shape[1]
    lane, rgrp = tidx % LANES, tidx // LANES
    warp, wlane = tidx // 32, tidx % 32
    first_row = tile_r * TILE + rgrp * PASSES
    col = tile_c * TILE + lane * VEC
    # one view of the thread's 8 rows of Q (a local_tile per row, as store_row_chunk, adds 48 SASS)
    q_rows = cute.local_tile(mQ, (PASSES, VEC), (first_row // PASSES, col // VEC))

    values = [_dual_op(op, [_read_chunk(sl, tidx, p, stage) for sl in slots]) for p in range(PASSES)]
    row_max = [abs(values[p]).reduce(cute.ReductionOp.MAX, Float32(0.0), 0) for p in range(PASSES)]
    # rows: 1x128 along the feature dim; lanes 2ρ, 2ρ + 1 of a row group own row ρ's scale
    scale, inv = scale_and_inverse(_row_max_scattered(row_max, lane))
    my_row = first_row + (lane // 2) % PASSES
    if lane % 2 == 0 and my_row < rows:
        mS[my_row, tile_c] = scale
    for p in cutlass.range_constexpr(PASSES):
        inv_p = cute.arch.shuffle_sync(inv, offset=(wlane & LANES) + 2 * p)
        codes = cute.make_rmem_tensor((VEC,), cutlass.Float8E4M3FN)
        codes.store((values[p] * inv_p).to(cutlass.Float8E4M3FN))
        if first_row + p < rows and col < cols:
            cute.autovec_copy(codes, q_rows[p, None])

    # columns: 1x128 along tokens. Maxima over the thread's 8 tokens, the warp's 16, then the
    # tile's 128 from the 8 warps' partials in shared memory
    col_max = cute.make_rmem_tensor((VEC,), Float32)
    for j in cutlass.range_constexpr(VEC):
        m = abs(values[0][j])
        for p in cutlass.range_constexpr(1, PASSES):
            m = cute.arch.fmax(m, abs(values[p][j]))
        col_max[j] = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=16))
    if wlane < LANES:
        cute.autovec_copy(col_max, cute.local_tile(col_part[(stage, warp, None)], (VEC,), (wlane,)))
    cute.arch.sync_threads()
    # lane m: the scales of tile columns 4m .. 4m + 3 (every warp computes all 128)
    quad = cute.make_rmem_tensor((4,), Float32)
    cute.autovec_copy(cute.local_tile(col_part[(stage, 0, None)], (4,), (wlane,)), quad)
    for w in cutlass.range_constexpr(1, WARPS_PER_CTA):
        other = cute.make_rmem_tensor((4,), Float32)
        cute.autovec_copy(cute.local_tile(col_part[(stage, w, None)], (4,), (wlane,)), other)
        for c in cutlass.range_constexpr(4):
            quad[c] = cute.arch.fmax(quad[c], other[c])
    if cutlass.const_expr(t_rows > 1):  # the block's maximum: over the lane's 4 columns, then its lanes
        block_max = cute.arch.fmax(cute.arch.fmax(quad[0], quad[1]), cute.arch.fmax(quad[2], quad[3]))
        for offset in (16, 8, 4, 2, 1):
            if cutlass.const_expr(4 * offset < t_rows):
                block_max = cute.arch.fmax(block_max, cute.arch.shuffle_sync_bfly(block_max, offset=offset))
        for c in cutlass.range_constexpr(4):
            quad[c] = block_max
    quad_inv = cute.make_rmem_tensor((4,), Float32)
    quad_scale = cute.make_rmem_tensor((4,), Float32)
    for c in cutlass.range_constexpr(4):
        quad_scale[c], quad_inv[c] = scale_and_inverse(quad[c])
    if cutlass.const_expr(t_rows == TILE):
        if tidx == 0:
            mST[tile_c, tile_r] = quad_scale[0]
    elif cutlass.const_expr(t_rows > 1):
        lanes_per_block = t_rows // 4
        if warp == 0 and wlane % lanes_per_block == 0 and tile_c * TILE + 4 * wlane < cols:
            mST[tile_c * (TILE // t_rows) + wlane // lanes_per_block, tile_r] = quad_scale[0]
    elif warp == 0:
        st_cols = cute.local_tile(mST, (4, 1), (tile_c * (TILE // 4) + wlane, tile_r))
        for c in cutlass.range_constexpr(4):
            if tile_c * TILE + 4 * wlane + c < cols:
                st_cols[c, 0] = quad_scale[c]
    # column lane·8 + j's inverse sits in lane 2·lane + j / 4, entry j % 4
    for h in cutlass.range_constexpr(2):
        if cutlass.const_expr(op == "copy"):
            half = [_read_half_chunk(slots[0], tidx, p, stage, h) for p in range(PASSES)]
        for jj in cutlass.range_constexpr(VEC // 2):
            j = h * (VEC // 2) + jj
            inv_j = quad_inv[0]
            if cutlass.const_expr(t_rows < TILE):
                inv_j = cute.arch.shuffle_sync(quad_inv[jj], offset=2 * lane + h)
            if cutlass.const_expr(op == "copy"):
                stage_column(tile_t, column_codes(half, jj, inv_j), lane, rgrp, j)
            else:  # one CTA per SM: the computed values stay in registers, not computed twice
                stage_column(tile_t, column_codes(values, j, inv_j), lane, rgrp, j)
    cute.arch.sync_threads()
    store_transposed(tile_t, mQT, tile_c * TILE, cols, tile_r * TILE, t_pad, tidx)


@cute.jit
def _read_half_chunk(slots: cute.Tensor, tidx, chunk, stage, half):
    frag = cute.make_rmem_tensor((VEC // 2,), slots.element_type)
    cute.autovec_copy(cute.local_tile(slots[(None, tidx, chunk, stage)], (VEC // 2,), (half,)), frag)
    return frag.load().to(Float32)


@cute.kernel
def _quant_dual_kernel(mX: cute.Tensor, mX2: cute.Tensor, mX3: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor,
                       mQT_u8: cute.Tensor, mST: cute.Tensor, op: cutlass.Constexpr, t_rows: cutlass.Constexpr):
    """``op``'s inputs are the first ``DUAL_OPS[op]`` of mX, mX2, mX3 (all of one shape). ``mST``:
    [ceil(cols / t_rows), ceil(rows / 128)]."""
    tidx, _, _ = cute.arch.thread_idx()
    after_previous_grid()
    bidx, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    mQ = as_fp8(mQ_u8)
    mQT = as_fp8(mQT_u8)
    smem = cutlass.memory.SmemAllocator()
    col_part = _alloc_col_partials(smem)
    tile_t = alloc_transposed_tile(smem)
    inputs = [mX, mX2, mX3][:DUAL_OPS[op]]
    slots = [_alloc_slots(smem, x.element_type, PASSES, 2) for x in inputs]

    tiles_r, tiles_c = mST.shape[1], mS.shape[1]
    n_tiles = tiles_r * tiles_c
    _prefetch_dual(inputs, slots, tidx, bidx, n_tiles, tiles_r, tiles_c, 0)
    for i in range((n_tiles - bidx + grid - 1) // grid):
        tile = bidx + i * grid
        stage = i % 2
        # the thread read its chunks of the other stage during the previous tile: refill them
        _prefetch_dual(inputs, slots, tidx, tile + grid, n_tiles, tiles_r, tiles_c, 1 - stage)
        cute.arch.cp_async_wait_group(1)
        tile_r, tile_c = _dual_tile_coords(tile, tiles_r, tiles_c)
        _dual_tile(slots, stage, mQ, mS, mQT, mST, col_part, tile_t, tile_r, tile_c, tidx, op, t_rows)


def dual_ctas_per_sm(input_bits: int, inputs: int = 1) -> int:
    """Resident CTAs per SM of the dual kernel (its registers are capped to match: 128 per thread
    at 2 CTAs, no spills; the 80 of 3 CTAs spill). Two stages of one 16-bit input (32 KB each),
    the transposed tile (16 KB) and the column maxima (8 KB) fit twice in shared memory; FP32
    stages (64 KB each) or the SwiGLU ops' two or three inputs once."""
    return 2 if input_bits <= 16 and inputs == 1 else 1


def _launch_dual(inputs: list, mQ_u8: cute.Tensor, mS: cute.Tensor, mQT_u8: cute.Tensor, mST: cute.Tensor,
                 max_ctas: cutlass.Int32, stream, op: str, t_rows: int):
    grid = cutlass.min(mST.shape[1] * mS.shape[1], max_ctas)
    padded = inputs + [inputs[0]] * (3 - len(inputs))  # unused kernel arguments
    _quant_dual_kernel(*padded, mQ_u8, mS, mQT_u8, mST, op, t_rows).launch(
        grid=(grid, 1, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True,
        min_blocks_per_mp=dual_ctas_per_sm(inputs[0].element_type.width, len(inputs)), preferred_smem_carveout=100)


@cute.jit
def quant_dual(mX: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor, mQT_u8: cute.Tensor, mST: cute.Tensor,
               max_ctas: cutlass.Int32, stream, t_rows: cutlass.Constexpr = 1):
    """``max_ctas``: the CTAs resident at once on the device (the grid of the persistent walk);
    ``t_rows``: the transposed half (the weight gradient's B operand) in 1x128 (1), 16x128 (16) or
    128x128 (128) blocks."""
    _launch_dual([mX], mQ_u8, mS, mQT_u8, mST, max_ctas, stream, "copy", t_rows)


@cute.jit
def swiglu_dual(mG: cute.Tensor, mU: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor, mQT_u8: cute.Tensor,
                mST: cute.Tensor, max_ctas: cutlass.Int32, stream, t_rows: cutlass.Constexpr = 1):
    """Both quantizations of ``silu(g) · u`` (the dense SwiGLU MLP's activation)."""
    _launch_dual([mG, mU], mQ_u8, mS, mQT_u8, mST, max_ctas, stream, "swiglu", t_rows)


@cute.jit
def swiglu_dgate_dual(mG: cute.Tensor, mU: cute.Tensor, mDA: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor,
                      mQT_u8: cute.Tensor, mST: cute.Tensor, max_ctas: cutlass.Int32, stream):
    """Both quantizations of the gate's gradient ``silu_backward(da · u, g)``."""
    _launch_dual([mG, mU, mDA], mQ_u8, mS, mQT_u8, mST, max_ctas, stream, "swiglu_dgate", False)


@cute.jit
def swiglu_dup_dual(mG: cute.Tensor, mDA: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor, mQT_u8: cute.Tensor,
                    mST: cute.Tensor, max_ctas: cutlass.Int32, stream):
    """Both quantizations of the up projection's gradient ``da · silu(g)``."""
    _launch_dual([mG, mDA], mQ_u8, mS, mQT_u8, mST, max_ctas, stream, "swiglu_dup", False)


# ---------------------------------------------------------------------------------------------
# The token-major half alone, of rows gathered through a map (the K-grouped weight-gradient
# operand): virtual row i of the tile grid is ``mX[mSrc[i]]``, or zeros where ``mSrc[i] < 0``.
# Bit-identical to the dual kernel's transposed output of the gathered, zero-filled rows.
@cute.kernel
def _quant_t_gathered_kernel(mX: cute.Tensor, mSrc: cute.Tensor, mQT_u8: cute.Tensor, mST: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    after_previous_grid()
    tile_r, tile_c, _ = cute.arch.block_idx()
    mQT = as_fp8(mQT_u8)
    smem = cutlass.memory.SmemAllocator()
    col_max = _alloc_col_max(smem)
    tile_t = alloc_transposed_tile(smem)

    cols = mX.shape[1]
    lane, rgrp = tidx % LANES, tidx // LANES
    row0, col = tile_r * TILE, tile_c * TILE + lane * VEC
    values = []
    for p in cutlass.range_constexpr(PASSES):
        i = row0 + rgrp * PASSES + p
        src = cutlass.Int32(-1)
        if i < mSrc.shape[0]:
            src = cutlass.Int32(mSrc[i])
        frag = cute.make_rmem_tensor((1, VEC), mX.element_type)
        frag.fill(0)
        if src >= 0 and col < cols:
            cute.autovec_copy(cute.local_tile(mX, (1, VEC), (src, col // VEC)), frag)
        values.append(frag.load().to(Float32))
    _quantize_columns(values, col_max, tile_t, mQT, mST, tile_r, tile_c, cols, row0, tidx)


@cute.jit
def quant_t_gathered(mX: cute.Tensor, mSrc: cute.Tensor, mQT_u8: cute.Tensor, mST: cute.Tensor, stream):
    _quant_t_gathered_kernel(mX, mSrc, mQT_u8, mST).launch(
        grid=(mST.shape[1], (mX.shape[1] + TILE - 1) // TILE, 1), block=(THREADS, 1, 1), stream=stream,
        use_pdl=True)
