"""Hopper (sm_90a) weight-only GEMM for decode: ``y = x · dequant(W)ᵀ``, ``x`` bf16, ``W`` NVFP4 or FP8.

Swap-AB: the CTA computes a ``yᵀ`` tile, 64 rows of ``W`` as the wgmma M side and the tokens as
its N side (``tile_m`` = 8..128), so one token costs one 8-wide wgmma column, not a 64-row tile.

* warp 8: TMA producer. Per 128-wide K chunk, one stage: the chunk's packed weight (one box;
  layout in ``lowprec.gemm.weight_only``) and the ``tile_m x 128`` slice of ``x`` (rows past M
  and columns past K read as zeros).
* warpgroups 0, 1 (warps 0-7): consumers, each over the 64 rows and half of every chunk's k-steps
  (its own accumulator; the two are summed in a fixed order at the end). Per chunk a thread reads
  its code words (and NVFP4's scale record) from shared memory, decodes each 16-wide k-step into
  the 4 bf16x2 registers of its A fragment and issues the wgmma with A from registers and ``x``
  from shared memory; the next chunk is decoded while they run (two A register sets). NVFP4: a
  shift and a mask put two E2M1 codes in bf16 position as ``code * 2^-126``, one
  ``mul.rn.bf16x2`` by ``scale * 2^116`` (exact). FP8: masks and shifts put two E4M3 codes in bf16
  position (``value * 2^-120``), one multiply by 2^120 (exact); each chunk's products go to a
  fresh accumulator, added times the chunk's block scale (promotion).
* few tokens (``warp_mma``): the same decode into the same A fragment words, the products on
  warp-level ``mma.sync`` m16n8k16 (``x`` fragments by ``ldmatrix``; 8 to 32 tokens), one chunk
  per loop trip and the stage released once they are issued (the token widths per format that
  take it: ``weight_only_interface.WARP_MMA_MAX_TILE_M``, measured in NOTES.md).
* epilogue: ``y = acc * scale (+ bias)`` (NVFP4: the global scale times 2^10; FP8: 1). With
  split-K (the K chunks of a tile spread over the ``splits`` CTAs of a cluster so that small N
  fills the GPU), each CTA stores its FP32 partial to a global workspace; after a cluster
  barrier (release / acquire) each CTA sums a share of the tile's outputs over the partials in
  split order (deterministic) and writes them.
* programmatic dependent launch: the first stages' weight loads go out before the previous
  kernel on the stream has finished (weights are constants); ``x`` and every global write wait.
* grouped (NVFP4 experts, ``grouped=True``): the experts' packed weights stacked, ``x`` and ``y``
  the MoE's expert-contiguous rows with ``group_ends``. Grid z counts token tiles; each warp finds
  its CTA's (expert, tile) from ``group_ends`` (a warp scan of per-lane tile counts, a ballot), CTAs
  past the last tile return; the wait for the previous grid comes first (it writes the ends).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from ...cute.pdl import after_previous_grid
from ...cute.sm90.tma_ring import TmaRing, tma_partition_tiles
from ...cute.utils import fence_operand
from ..weight_only import (
    CHUNK_BYTES,
    CHUNK_K,
    CODE_BYTES,
    DECODE_EXP,
    FP8_CHUNK_BYTES,
    FP8_DECODE_EXP,
    FP8_DIRECT_MASK,
    FP8_SCALE_BLOCK,
    FP8_SHIFT,
    FP8_SPLIT_MASKS,
    PAIR3_MASKS,
    PAIR3_ROT,
    PAIR_MASK,
    PAIR_ROT,
    ROW_BYTES,
    SPLITS,
    TILE_MS,
    TILE_N,
)

_HANDOFF_BAR = 1  # named barrier of the two consumer warpgroups

FORMATS = ("nvfp4", "fp8")
_CHUNK_BYTES = {"nvfp4": CHUNK_BYTES, "fp8": FP8_CHUNK_BYTES}
# bf16 2^FP8_DECODE_EXP in both halves: undoes the FP8 decode's 2^-120
_BF16X2_FP8_DECODE = ((127 + FP8_DECODE_EXP) << 7) * 0x10001


def _as_i32(v: int) -> int:
    """A 32-bit pattern as a signed 32-bit immediate."""
    return v - (1 << 32) if v >= 1 << 31 else v


@dsl_user_op
def _mul_bf16x2(a, b, *, loc=None, ip=None):
    """Two bf16 products (round to nearest; subnormals kept, which the decoded 0.5 codes are)."""
    return cutlass.Int32(llvm.inline_asm(
        T.i32(), [cutlass.Int32(a).ir_value(loc=loc, ip=ip), cutlass.Int32(b).ir_value(loc=loc, ip=ip)],
        "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", loc=loc, ip=ip))


@dsl_user_op
def _rotl_masked(w, r: int, mask: int, *, loc=None, ip=None):
    """``rotl(w, r) & mask``. Where no masked bit wraps around, the shift is a multiply by ``2^r``
    (``IMAD.SHL``, on the FMA pipe), so the integer pipe, the decode's busiest, runs only the mask
    (``LOP3``); else a funnel shift (``SHF``; ptxas makes a wide multiply two ``LEA``)."""
    w = cutlass.Int32(w).ir_value(loc=loc, ip=ip)
    m = _as_i32(mask)
    if r == 0:
        body = f"and.b32 $0, $1, {m};"
    elif all(b >= r for b in range(32) if mask >> b & 1):
        body = f"{{ .reg .b32 t; mul.lo.u32 t, $1, {1 << r}; and.b32 $0, t, {m}; }}"
    else:
        body = f"{{ .reg .b32 t; shf.l.wrap.b32 t, $1, $1, {r}; and.b32 $0, t, {m}; }}"
    return cutlass.Int32(llvm.inline_asm(T.i32(), [w], body, "=r,r", loc=loc, ip=ip))


@dsl_user_op
def _mul_bf16x2_by_half(a, b, hi: bool, *, loc=None, ip=None):
    """``a`` times half ``hi`` of ``b`` broadcast to both halves (bf16x2, round to nearest)."""
    pick = "{o, s}" if hi else "{s, o}"
    return cutlass.Int32(llvm.inline_asm(
        T.i32(), [cutlass.Int32(a).ir_value(loc=loc, ip=ip), cutlass.Int32(b).ir_value(loc=loc, ip=ip)],
        f"{{ .reg .b16 s, o; .reg .b32 ss; mov.b32 {pick}, $2; mov.b32 ss, {{s, s}}; "
        "mul.rn.bf16x2 $0, $1, ss; }", "=r,r,r", loc=loc, ip=ip))


@dsl_user_op
def _e4m3x2_to_f16x2(word, hi: bool, *, loc=None, ip=None):
    """The two E4M3 bytes of half ``hi`` of ``word`` as f16x2 (exact; byte 0 -> low half)."""
    half = "hi" if hi else "lo"
    return cutlass.Int32(llvm.inline_asm(
        T.i32(), [cutlass.Int32(word).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $1;\n"
        f"cvt.rn.f16x2.e4m3x2 $0, {half};\n}}",
        "=r,r", loc=loc, ip=ip))


@cute.jit
def decode_nvfp4(w, sc_word, hi: cutlass.Constexpr, a_words, s: cutlass.Constexpr):
    """A fragment words 4s..4s+3 (pairs a0..a3) of k-step slot ``s`` from code word ``w`` and half
    ``hi`` of scale word ``sc_word`` (layout: ``lowprec.gemm.weight_only``): ``code * scale * 2^-10``
    in bf16, exact."""
    h = _e4m3x2_to_f16x2(sc_word, hi)  # (scale of row r0, of row r1) as f16
    # bf16 scale * 2^116. No mask after the shift: an E4M3 value's f16 has its low 3 bits zero
    # and the scales are >= 0 (pack_nvfp4 checks), so nothing crosses from one half into the other
    s2 = (h >> 3) + cutlass.Int32(0x72007200)
    # the packed layout's rotations (lowprec.gemm.weight_only._PAIR_BITS): pairs 0-2 one rotate
    # and one mask each, pair 3 two of each
    p3 = (_rotl_masked(w, PAIR3_ROT[0], PAIR3_MASKS[0]) | _rotl_masked(w, PAIR3_ROT[1], PAIR3_MASKS[1]))
    for j in cutlass.range_constexpr(3):
        a_words[4 * s + j] = _mul_bf16x2_by_half(_rotl_masked(w, PAIR_ROT[j], PAIR_MASK), s2, j % 2 == 1)
    a_words[4 * s + 3] = _mul_bf16x2_by_half(p3, s2, True)


class WeightOnlySm90:
    """The kernel for one weight format ``fmt``, token tile width ``tile_m`` (the wgmma N), ring
    depth ``stages``, ``ctas_per_sm`` resident CTAs (the register budget the compiler is held to),
    ``splits`` (split-K: the cluster size along grid y) and ``warp_mma`` (NVFP4: the products on
    warp-level ``mma.sync`` m16n8k16 instead of wgmma; see ``_mainloop_warp``)."""

    def __init__(self, fmt: str, tile_m: int, stages: int, ctas_per_sm: int, splits: int, warp_mma: bool = False,
                 grouped: bool = False):
        if fmt not in FORMATS:
            raise ValueError(f"fmt: expected one of {FORMATS}, got {fmt!r}")
        self.fmt, self.chunk_bytes = fmt, _CHUNK_BYTES[fmt]
        self.chunk_rows = self.chunk_bytes // ROW_BYTES
        if tile_m not in TILE_MS:
            raise ValueError(f"tile_m: expected one of {TILE_MS}, got {tile_m}")
        if splits not in SPLITS:
            raise ValueError(f"splits: expected one of {SPLITS}, got {splits}")
        if grouped and fmt != "nvfp4":
            raise ValueError("grouped: NVFP4 only")
        self.tile_m, self.stages, self.ctas_per_sm, self.splits = tile_m, stages, ctas_per_sm, splits
        self.warp_mma, self.grouped = warp_mma, grouped
        # warps 0-7: two consumer warpgroups, each the full 64 rows over half of every chunk's
        # k-steps (warpgroup w: k-steps 4w..4w+3) into its own accumulator; warp 8: producer
        self.wg_threads = 128
        self.consumer_threads = 2 * self.wg_threads
        self.producer_warp = 8

    def _mma(self):
        if self.warp_mma:  # the 4 warps of a warpgroup each 16 of the 64 rows, as the wgmma's A fragment
            return cute.make_tiled_mma(warp.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, (16, 8, 16)),
                                       (4, 1, 1), permutation_mnk=(TILE_N, self.tile_m, 16))
        return sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), tiler_mn=(64, self.tile_m), a_source=warpgroup.OperandSource.RMEM,
        )

    def _x_smem_layout(self):
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, cutlass.BFloat16, CHUNK_K), cutlass.BFloat16)
        return cute.tile_to_shape(atom, (self.tile_m, CHUNK_K, self.stages), order=(0, 1, 2))

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # (M, K) bf16, K contiguous
        mW_raw: cute.Tensor,  # (n_tiles, k_chunks * rows per chunk, 256) uint8: the packed weight
        mY: cute.Tensor,  # (M, N) bf16
        mBias: cute.Tensor,  # (N,) bf16 (read only with has_bias)
        mScale: cute.Tensor,  # fp32: NVFP4 (experts, 1) the global scales; FP8 (ceil(N/128), k_chunks) block scales
        mWork: cute.Tensor,  # (>= splits * M * N,) fp32: split-K partials
        mGroupEnds: cute.Tensor,  # (experts,) int32, grouped: expert e owns rows [ends[e-1], ends[e]) of x and y
        group_tiles: cutlass.Int32,  # grouped: the grid's token tiles, at least the experts' tiles together
        has_bias: cutlass.Int32,
        stream,
    ):
        mW = cute.make_tensor(mW_raw.iterator, cute.select(mW_raw.layout, mode=[1, 2, 0]))
        sX_layout = self._x_smem_layout()
        sW_layout = cute.make_layout((self.chunk_rows, ROW_BYTES, self.stages),
                                     stride=(ROW_BYTES, 1, self.chunk_bytes))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_x, tma_tensor_x = cpasync.make_tiled_tma_atom(
            g2s, mX, cute.slice_(sX_layout, (None, None, 0)), (self.tile_m, CHUNK_K))
        tma_w, tma_tensor_w = cpasync.make_tiled_tma_atom(
            g2s, mW, cute.slice_(sW_layout, (None, None, 0)), (self.chunk_rows, ROW_BYTES))

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            # warpgroup 1's accumulator, handed to warpgroup 0 (thread-major: no bank conflicts)
            sAcc: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, TILE_N * self.tile_m], 16]
            sX: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sX_layout)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(sW_layout)], 128]

        self.shared_storage = SharedStorage
        m, n = cute.size(mY, mode=[0]), cute.size(mY, mode=[1])
        k_chunks = cute.size(mW, mode=[0]) // self.chunk_rows
        z_tiles = (m + self.tile_m - 1) // self.tile_m
        if cutlass.const_expr(self.grouped):
            z_tiles = group_tiles
        self.kernel(
            tma_x, tma_tensor_x, tma_w, tma_tensor_w, mY, mBias, mScale, mWork, mGroupEnds, has_bias,
            k_chunks, sX_layout, sW_layout, self._mma(),
        ).launch(
            grid=((n + TILE_N - 1) // TILE_N, self.splits, z_tiles),
            block=[self.consumer_threads + 32, 1, 1],
            cluster=(1, self.splits, 1),
            min_blocks_per_mp=self.ctas_per_sm,
            use_pdl=True,
            preferred_smem_carveout=100,  # percent: all of the SM's shared memory (several CTAs per SM)
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        tma_x: cute.CopyAtom, mX: cute.Tensor,
        tma_w: cute.CopyAtom, mW: cute.Tensor,
        mY: cute.Tensor, mBias: cute.Tensor, mScale: cute.Tensor, mWork: cute.Tensor,
        mGroupEnds: cute.Tensor,
        has_bias: cutlass.Int32, k_chunks: cutlass.Int32,
        sX_layout: cute.ComposedLayout, sW_layout: cute.Layout, mma: cute.TiledMma,
    ):
        n_tile, split, z = cute.arch.block_idx()
        if cutlass.const_expr(self.grouped):
            # the group ends come from the previous kernel (the routing): wait for it first, and
            # read no weight of an expert that got no tokens
            cute.arch.griddepcontrol_wait()
            expert, m_tile, found = self._group_tile(mGroupEnds, z)
            row_start = cutlass.Int32(0)
            if expert > 0:
                row_start = mGroupEnds[expert - 1]
            # bounded by y's rows: ends past them (bad input) cannot make a store out of bounds
            row_end = cutlass.min(mGroupEnds[expert], cute.size(mY, mode=[0]))
            if found:
                self._tile(tma_x, mX, tma_w, mW, mY, mBias, mScale, mWork, has_bias, k_chunks, sX_layout, sW_layout,
                           mma, n_tile, split, expert, m_tile, row_start, row_end)
        else:
            self._tile(tma_x, mX, tma_w, mW, mY, mBias, mScale, mWork, has_bias, k_chunks, sX_layout, sW_layout,
                       mma, n_tile, split, 0, z, cutlass.Int32(0), cute.size(mY, mode=[0]))

    @cute.jit
    def _group_tile(self, mGroupEnds, z):
        """Grouped: the ``z``-th non-empty token tile over the experts in order, as (expert, tile
        within it, whether it exists). Each warp finds it alone (same answer): lane l sums the
        tiles of a contiguous range of experts, a warp scan of those sums finds the lane whose
        range holds tile ``z``, and that lane's walk finds the expert."""
        experts = cute.size(mGroupEnds)
        lane = cute.arch.lane_idx()
        per_lane = (experts + 31) // 32
        first = lane * per_lane
        own = cutlass.Int32(0)
        for i in cutlass.range(per_lane, unroll=1):
            e = first + i
            if e < experts:
                own = own + (self._rows_of(mGroupEnds, e) + self.tile_m - 1) // self.tile_m
        total = own
        for off in cutlass.range_constexpr(5):
            v = cute.arch.shuffle_sync_up(total, 1 << off)
            if lane >= (1 << off):
                total = total + v
        before = total - own
        mine = (before <= z) & (z < total)
        holder = cute.arch.vote_ballot_sync(mine)
        expert, m_tile = cutlass.Int32(0), cutlass.Int32(0)
        if mine:  # this lane's range holds tile z: walk it
            seen = before
            for i in cutlass.range(per_lane, unroll=1):
                e = first + i
                if e < experts:
                    tiles = (self._rows_of(mGroupEnds, e) + self.tile_m - 1) // self.tile_m
                    if (seen <= z) & (z < seen + tiles):
                        expert, m_tile = e, z - seen
                    seen = seen + tiles
        src = cutlass.Int32(31) - cutlass.Int32(cute.arch.clz(holder))
        src = cutlass.max(src, 0)
        return cute.arch.shuffle_sync(expert, src), cute.arch.shuffle_sync(m_tile, src), holder != 0

    @cute.jit
    def _rows_of(self, mGroupEnds, e):
        start = cutlass.Int32(0)
        if e > 0:
            start = mGroupEnds[e - 1]
        return cutlass.max(mGroupEnds[e] - start, 0)  # decreasing ends (bad input): no rows

    @cute.jit
    def _tile(self, tma_x, mX, tma_w, mW, mY, mBias, mScale, mWork, has_bias, k_chunks, sX_layout, sW_layout, mma,
              n_tile, split, expert, m_tile, row_start, row_end):
        """One CTA's output tile: W rows ``n_tile`` of ``expert``, token rows ``row_start + m_tile *
        tile_m`` on (below ``row_end``), K chunks of split ``split``."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        # balanced split: every split gets floor or ceil of k_chunks / splits (>= 1: splits <= k_chunks)
        kc_first = split * k_chunks // self.splits
        kc_count = (split + 1) * k_chunks // self.splits - kc_first
        if warp_idx == self.producer_warp:
            cpasync.prefetch_descriptor(tma_x)
            cpasync.prefetch_descriptor(tma_w)
        storage = SmemAllocator().allocate(self.shared_storage)
        stage_bytes = self.chunk_bytes + self.tile_m * CHUNK_K * 2
        ring = TmaRing.create(storage.mbar.data_ptr(), self.stages, stage_bytes, self.consumer_threads // 32,
                              cute.make_layout((1, 1, 1, 1)))
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        sX = storage.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)
        sW = storage.sW.get_tensor(sW_layout)
        pipeline_init_wait(cluster_shape_mn=(1, 1))

        if warp_idx == self.producer_warp:
            tXsX, tXgX = tma_partition_tiles(
                tma_x, sX, cute.local_tile(cute.domain_offset((row_start, 0), mX), (self.tile_m, CHUNK_K),
                                           (m_tile, None)))
            # a grouped weight stacks the experts' tiles: expert e's are e * (tiles per expert) on
            w_tile = n_tile + expert * ((cute.size(mY, mode=[1]) + TILE_N - 1) // TILE_N)
            tWsW, tWgW = tma_partition_tiles(
                tma_w, sW, cute.local_tile(mW[(None, None, w_tile)], (self.chunk_rows, ROW_BYTES), (None, 0)))
            # programmatic dependent launch: the weights are constants, so the first stages'
            # weight loads go out while the previous kernel drains; x (its output, maybe) and
            # every global write wait for it
            first = cutlass.min(kc_count, self.stages)
            state = ring.producer_state()
            for i in cutlass.range(first, unroll=1):
                ring.pipe.producer_acquire(state)
                cute.copy(tma_w, tWgW[(None, kc_first + i)], tWsW[(None, state.index)],
                          tma_bar_ptr=ring.pipe.producer_get_barrier(state))
                state.advance()
            after_previous_grid()
            x_state = ring.producer_state()
            for i in cutlass.range(first, unroll=1):
                cute.copy(tma_x, tXgX[(None, kc_first + i)], tXsX[(None, x_state.index)],
                          tma_bar_ptr=ring.pipe.producer_get_barrier(x_state))
                ring.pipe.producer_commit(x_state)
                x_state.advance()
            for i in cutlass.range(first, kc_count, unroll=1):
                ring.pipe.producer_acquire(state)
                bar = ring.pipe.producer_get_barrier(state)
                cute.copy(tma_w, tWgW[(None, kc_first + i)], tWsW[(None, state.index)], tma_bar_ptr=bar)
                cute.copy(tma_x, tXgX[(None, kc_first + i)], tXsX[(None, state.index)], tma_bar_ptr=bar)
                ring.pipe.producer_commit(state)
                state.advance()
            ring.producer_tail(state)
            if cutlass.const_expr(self.splits > 1):  # every thread of the cluster takes the barrier
                cute.arch.cluster_arrive_relaxed()
                cute.arch.cluster_wait()
        elif warp_idx < self.producer_warp:
            wg = tidx // self.wg_threads
            t = tidx % self.wg_threads
            if cutlass.const_expr(self.warp_mma):
                acc = self._mainloop_warp(wg, t, mma, sX, sW, ring, kc_count, mScale, n_tile, kc_first)
            else:
                acc = self._mainloop(wg, t, mma, sX, sW, ring, kc_count, mScale, n_tile, kc_first)
            # warpgroup 0 takes warpgroup 1's sum (acc0 + acc1: a fixed order)
            sAcc = storage.sAcc.get_tensor(cute.make_layout((cute.size(acc), self.wg_threads),
                                                            stride=(self.wg_threads, 1)))
            if wg == 1:
                for i in cutlass.range_constexpr(cute.size(acc)):
                    sAcc[i, t] = acc[i]
            cute.arch.barrier(barrier_id=_HANDOFF_BAR, number_of_threads=self.consumer_threads)
            if wg == 0:
                for i in cutlass.range_constexpr(cute.size(acc)):
                    acc[i] = acc[i] + sAcc[i, t]
            cute.arch.griddepcontrol_wait()  # before the first global write (returns at once by now)
            self._epilogue(wg, t, mma, acc, mY, mBias, mScale, mWork, has_bias, n_tile, split, expert,
                           row_start + m_tile * self.tile_m, row_end)

    @cute.jit
    def _mainloop(self, wg, t, mma, sX, sW, ring, kc_count, mScale, n_tile, kc_first):
        """Warpgroup ``wg`` over every chunk: decode its 4 k-steps, issue their wgmma (decoding the
        next chunk runs under them); a chunk's stage is released once its wgmma retired (one
        chunk later). Two A-register sets (and, FP8, two chunk accumulators) alternate."""
        thr = mma.get_slice(t)
        tCrB = mma.make_fragment_B(thr.partition_B(sX))  # (atom, n, k-steps, stages)
        # two sets of the A fragment words of 4 k-steps: set p holds k-steps 4p..4p+3 of tCrA's layout
        a_words, tCrA_w, acc_shape, acc = self._fragments(thr)
        mma_acc = mma
        mma_acc.set(warpgroup.Field.ACCUMULATE, True)
        if cutlass.const_expr(self.fmt == "nvfp4"):
            frags = (tCrA_w, tCrB, a_words, *self._nvfp4_views(sW), None, None, None)
        else:
            codes, sCodes = self._fp8_views(sW)
            # a fresh accumulator per chunk (two, alternating) and its block scale
            chunk_acc = [cute.make_rmem_tensor(acc_shape, cutlass.Float32) for _ in range(2)]
            chunk_scale = cute.make_rmem_tensor((2,), cutlass.Float32)
            mma_zero = self._mma()
            mma_zero.set(warpgroup.Field.ACCUMULATE, False)
            scale_row = mScale[(n_tile * TILE_N // FP8_SCALE_BLOCK, None)]
            frags = (tCrA_w, tCrB, a_words, codes, None, sCodes, None, chunk_acc, chunk_scale,
                     (mma_zero, scale_row, kc_first))
        state = ring.consumer_state()
        done = ring.consumer_state()  # the stage whose wgmma retire next
        # chunks in pairs: the A register set is a compile-time choice (set 0, then set 1)
        state, done = self._chunk(wg, t, mma_acc, acc, frags, ring, state, done, 0, False, 0)
        for i in cutlass.range((kc_count - 1) // 2, unroll=1):
            state, done = self._chunk(wg, t, mma_acc, acc, frags, ring, state, done, 1, True, 2 * i + 1)
            state, done = self._chunk(wg, t, mma_acc, acc, frags, ring, state, done, 0, True, 2 * i + 2)
        if kc_count % 2 == 0:
            state, done = self._chunk(wg, t, mma_acc, acc, frags, ring, state, done, 1, True, kc_count - 1)
        warpgroup.wait_group(0)
        if cutlass.const_expr(self.fmt == "fp8"):  # the last chunk's promotion
            self._promote(acc, frags, (kc_count - 1) % 2)
        fence_operand(acc)
        ring.release(done)
        return acc

    def _fragments(self, thr):
        """The A fragment of a chunk's 8 k-steps as Int32 words (``a_words``, what the decode
        writes) and as the MMA's bf16 fragment (``tCrA_w``, the same registers), and the zeroed
        FP32 accumulator of the 64 x ``tile_m`` tile (with its shape)."""
        tCrA = thr.make_fragment_A(thr.partition_shape_A((TILE_N, CHUNK_K)))
        a_words = cute.make_rmem_tensor((cute.size(tCrA) // 2,), cutlass.Int32)
        tCrA_w = cute.make_tensor(cute.recast_ptr(a_words.iterator, dtype=cutlass.BFloat16), tCrA.layout)
        acc_shape = thr.partition_shape_C((TILE_N, self.tile_m))
        acc = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
        acc.fill(0.0)
        return a_words, tCrA_w, acc_shape, acc

    def _nvfp4_views(self, sW):
        """NVFP4 per stage: the thread's 16-byte code record of its warpgroup's k-steps and the 8
        bytes of its quad's scale record that cover them (smem views), and their registers."""
        words = cute.recast_ptr(sW.iterator, dtype=cutlass.Int32)
        chunk_words = self.chunk_bytes // 4
        sCodes = cute.make_tensor(words, cute.make_layout((4, 2, self.wg_threads, self.stages),
                                                          stride=(1, 4 * self.wg_threads, 4, chunk_words)))
        sScales = cute.make_tensor(words + CODE_BYTES // 4, cute.make_layout(
            (2, 2, self.wg_threads // 4, self.stages), stride=(1, 2, 4, chunk_words)))
        return cute.make_rmem_tensor((4,), cutlass.Int32), cute.make_rmem_tensor((2,), cutlass.Int32), sCodes, sScales

    def _fp8_views(self, sW):
        """FP8 per stage: the thread's 32 bytes of codes of its warpgroup's k-steps (smem view) and
        their registers."""
        sCodes = cute.make_tensor(cute.recast_ptr(sW.iterator, dtype=cutlass.Int32), cute.make_layout(
            (8, 2, self.wg_threads, self.stages), stride=(1, 8 * self.wg_threads, 8, self.chunk_bytes // 4)))
        return cute.make_rmem_tensor((8,), cutlass.Int32), sCodes

    @cute.jit
    def _mainloop_warp(self, wg, t, mma, sX, sW, ring, kc_count, mScale, n_tile, kc_first):
        """Products on ``mma.sync``: per chunk, warpgroup ``wg`` reads its codes (NVFP4: and
        scales) and (ldmatrix) its 4 k-steps of ``x``, decodes into the same A fragment words as
        the wgmma path and issues 4 m16n8k16 per 8 tokens and warp (FP8: into a fresh chunk
        accumulator, added times the chunk's block scale). The products are synchronous, so the
        stage is released once they are issued (their operands are in registers) and no A
        register set is held."""
        thr = mma.get_slice(t)
        # ldmatrix of 2 (8 tokens) or 4 (16 or more: two n8 blocks a load) 8x8 matrices
        copy_b = cute.make_tiled_copy_B(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, min(4, self.tile_m // 4)), cutlass.BFloat16), mma)
        thr_copy_b = copy_b.get_slice(t)
        tXsX = thr_copy_b.partition_S(sX)  # (copy, n, k-steps, stages)
        tCrB = thr.make_fragment_B(thr.partition_shape_B((self.tile_m, CHUNK_K // 2)))  # this warpgroup's 4 k-steps
        tXrB = thr_copy_b.retile(tCrB)
        a_words, tCrA_w, acc_shape, acc = self._fragments(thr)
        if cutlass.const_expr(self.fmt == "nvfp4"):
            codes, scw, sCodes, sScales = self._nvfp4_views(sW)
        else:
            codes, sCodes = self._fp8_views(sW)
            chunk_acc = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
            scale_row = mScale[(n_tile * TILE_N // FP8_SCALE_BLOCK, None)]
        # the x fragments' ldmatrix addresses, swizzled once: a stage is a whole number of swizzle
        # atoms, so stage s's address is stage 0's plus s stage strides (no XOR per load)
        x_addr = []
        for j in cutlass.range_constexpr(4):
            raw = tXsX[(None, None, 4 * wg + j, 0)].iterator.toint()
            x_addr.append(raw ^ ((raw >> 3) & 0x70))
        stage_bytes = cute.cosize(cute.slice_(sX.layout, (None, None, 0))) * 2
        # a thread's rows of a k-step's x (32 tokens: two loads, 16 rows = two swizzle atoms apart,
        # an offset the swizzle leaves alone)
        x_frag = tXsX[(None, None, 0, 0)].layout
        state = ring.consumer_state()
        for i in cutlass.range(kc_count, unroll=1):
            if cutlass.const_expr(self.fmt == "fp8"):
                chunk_scale = scale_row[kc_first + i]  # a constant: read before the stage lands
            ring.wait(state)
            cute.autovec_copy(sCodes[(None, wg, t, state.index)], codes)
            if cutlass.const_expr(self.fmt == "nvfp4"):
                cute.autovec_copy(sScales[(None, wg, t // 4, state.index)], scw)
            for j in cutlass.range_constexpr(4):
                src = cute.make_tensor(cute.make_ptr(cutlass.BFloat16, x_addr[j] + state.index * stage_bytes,
                                                     cute.AddressSpace.smem, assumed_align=16), x_frag)
                cute.copy(copy_b, src, tXrB[(None, None, j)])
            for j in cutlass.range_constexpr(4):
                if cutlass.const_expr(self.fmt == "nvfp4"):
                    decode_nvfp4(codes[j], scw[j // 2], j % 2, a_words, j)
                else:
                    self._decode_fp8(codes[2 * j], codes[2 * j + 1], a_words, j)
            if cutlass.const_expr(self.fmt == "nvfp4"):
                for j in cutlass.range_constexpr(4):
                    cute.gemm(mma, acc, tCrA_w[(None, None, j)], tCrB[(None, None, j)], acc)
            else:
                chunk_acc.fill(0.0)
                for j in cutlass.range_constexpr(4):
                    cute.gemm(mma, chunk_acc, tCrA_w[(None, None, j)], tCrB[(None, None, j)], chunk_acc)
            ring.release(state)
            state.advance()
            if cutlass.const_expr(self.fmt == "fp8"):
                for v in cutlass.range_constexpr(cute.size(acc)):
                    acc[v] = acc[v] + chunk_scale * chunk_acc[v]
        return acc

    @cute.jit
    def _chunk(self, wg, t, mma, acc, frags, ring, state, done, a_set: cutlass.Constexpr,
               release_previous: cutlass.Constexpr, i):
        """Chunk ``i`` of warpgroup ``wg`` into A register set ``a_set``; returns the advanced
        (state, done) pipeline states."""
        tCrA_w, tCrB, a_words, codes, scw, sCodes, sScales, chunk_acc, chunk_scale, fp8_args = frags
        if cutlass.const_expr(self.fmt == "fp8"):
            mma_zero, scale_row, kc_first = fp8_args
            chunk_scale[a_set] = scale_row[kc_first + i]  # a constant: read before the stage lands
        ring.wait(state)
        cute.autovec_copy(sCodes[(None, wg, t, state.index)], codes)
        if cutlass.const_expr(self.fmt == "nvfp4"):
            cute.autovec_copy(sScales[(None, wg, t // 4, state.index)], scw)
            for j in cutlass.range_constexpr(4):
                decode_nvfp4(codes[j], scw[j // 2], j % 2, a_words, 4 * a_set + j)
        else:
            for j in cutlass.range_constexpr(4):
                self._decode_fp8(codes[2 * j], codes[2 * j + 1], a_words, 4 * a_set + j)
        warpgroup.fence()
        for j in cutlass.range_constexpr(4):
            # set a_set is stored where tCrA's k-steps 4 a_set .. +3 sit; B is this warpgroup's k-steps
            a, b = tCrA_w[(None, None, 4 * a_set + j)], tCrB[(None, None, 4 * wg + j, state.index)]
            if cutlass.const_expr(self.fmt == "nvfp4"):
                cute.gemm(mma, acc, a, b, acc)
            else:
                cute.gemm(mma_zero if j == 0 else mma, chunk_acc[a_set], a, b, chunk_acc[a_set])
        warpgroup.commit_group()
        warpgroup.wait_group(1)
        if cutlass.const_expr(release_previous):  # the previous chunk's wgmma have retired
            if cutlass.const_expr(self.fmt == "fp8"):
                self._promote(acc, frags, 1 - a_set)
            ring.release(done)
            done.advance()
        state.advance()
        return state, done

    @cute.jit
    def _promote(self, acc, frags, a_set):
        """FP8: acc += block scale * the chunk accumulator of set ``a_set`` (its wgmma retired)."""
        chunk_acc, chunk_scale = frags[7], frags[8]
        if cutlass.const_expr(isinstance(a_set, int)):
            src, sc = chunk_acc[a_set], chunk_scale[a_set]
            fence_operand(src)
            for v in cutlass.range_constexpr(cute.size(acc)):
                acc[v] = acc[v] + sc * src[v]
        else:  # the last chunk's set, known at run time
            if a_set == 0:
                self._promote(acc, frags, 0)
            else:
                self._promote(acc, frags, 1)

    @cute.jit
    def _decode_fp8(self, w0, w1, a_words, s: cutlass.Constexpr):
        """A fragment words 4s..4s+3 of k-step slot ``s`` from its two code words (exact): per
        word one mask places pair 0 (``value * 2^-120``), two shifts and masks pair 1, and a
        multiply by 2^120 finishes each (layout: ``lowprec.gemm.weight_only``)."""
        undo = cutlass.Int32(_BF16X2_FP8_DECODE)
        for q in cutlass.range_constexpr(2):
            w = w0 if q == 0 else w1
            direct = w & cutlass.Int32(_as_i32(FP8_DIRECT_MASK))
            split = (_rotl_masked(w, FP8_SHIFT, FP8_SPLIT_MASKS[0])
                     | ((w >> FP8_SHIFT) & cutlass.Int32(FP8_SPLIT_MASKS[1])))
            a_words[4 * s + 2 * q] = _mul_bf16x2(direct, undo)
            a_words[4 * s + 2 * q + 1] = _mul_bf16x2(split, undo)

    @cute.jit
    def _epilogue(self, wg, t, mma, acc, mY, mBias, mScale, mWork, has_bias, n_tile, split, expert, m0, row_end):
        """Warpgroup 0 holds the tile's sums (token rows ``m0`` on, below ``row_end``); with
        split-K both warpgroups reduce."""
        m, n = cute.size(mY, mode=[0]), cute.size(mY, mode=[1])
        tidx = wg * self.wg_threads + t
        thr = mma.get_slice(t)
        coords = thr.partition_C(cute.make_identity_tensor((TILE_N, self.tile_m)))
        n0 = n_tile * TILE_N
        scale = cutlass.Float32(1.0)  # FP8: the block scales were applied per chunk
        if cutlass.const_expr(self.fmt == "nvfp4"):
            scale = mScale[expert, 0] * cutlass.Float32(2.0 ** DECODE_EXP)
        if cutlass.const_expr(self.splits == 1):
            if wg == 0:
                for i in cutlass.range_constexpr(cute.size(acc)):
                    row, col = n0 + coords[i][0], m0 + coords[i][1]
                    if row < n and col < row_end:
                        mY[col, row] = self._out(acc[i] * scale, mBias, has_bias, row)
        else:
            if wg == 0:
                for i in cutlass.range_constexpr(cute.size(acc)):
                    row, col = n0 + coords[i][0], m0 + coords[i][1]
                    if row < n and col < row_end:
                        mWork[(split * m + col) * n + row] = acc[i]
            # barrier.cluster.arrive releases and .wait acquires at cluster scope: every split's
            # partial is visible to every CTA of the tile's cluster after it
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            # split s writes the tile's outputs s * 128 + [0, 128), + 128 * splits, ... (consecutive
            # threads, consecutive rows), each the sum of the partials in split order
            cols = cutlass.min(self.tile_m, row_end - m0)
            step = self.consumer_threads * self.splits
            for e in cutlass.range(split * self.consumer_threads + tidx, TILE_N * cols, step, unroll=1):
                row, col = n0 + e % TILE_N, m0 + e // TILE_N
                if row < n:
                    part = cute.make_rmem_tensor((self.splits,), cutlass.Float32)
                    for sp in cutlass.range_constexpr(self.splits):
                        part[sp] = mWork[(sp * m + col) * n + row]
                    total = part[0]
                    for sp in cutlass.range_constexpr(1, self.splits):
                        total = total + part[sp]
                    mY[col, row] = self._out(total * scale, mBias, has_bias, row)

    @cute.jit
    def _out(self, v, mBias, has_bias, row):
        if has_bias != 0:
            v = v + mBias[row].to(cutlass.Float32)
        return v.to(cutlass.BFloat16)
