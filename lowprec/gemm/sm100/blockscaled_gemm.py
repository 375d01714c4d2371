"""Blackwell (sm_100a) block-scaled GEMM in CuTe DSL: persistent, warp-specialized, 1-CTA or CTA pairs.

    D[m, n, l] = alpha * sum_k (A[m, k, l] * SFA[m, k // vec, l]) * (B[n, k, l] * SFB[n, k // vec, l])
                 (+ bias[n])

Formats (``GemmConfig.element_format``):
    "mxf8": A, B E4M3; scales E8M0, one per 32 K elements (``tcgen05.mma kind::mxf8f6f4``).
    "mxf4": A, B E2M1 (two per byte); scales E8M0, one per 32 K elements (``kind::mxf4``).
    "nvf4": A, B E2M1 (two per byte); scales E4M3, one per 16 K elements (``kind::mxf4nvf4``).

Contract of ``__call__(a_ptr, b_ptr, sfa_ptr, sfb_ptr, d_ptr, alpha_ptr, bias_ptr, counts_ptr, m, n,
k, batch, sm_count, stream)`` (global pointers, Int32 sizes; L = batch; ``counts`` [L] Int32 read
only by masked configs):
    A [L, M, K] and B [L, N, K], K contiguous, K a positive multiple of the K tile (128 for mxf8, 256 for
    mxf4 and nvf4) and pointers 16-byte aligned. D [L, M, N] in ``GemmConfig.out_dtype``, N
    contiguous, N a multiple of 16, 32-byte aligned. ``alpha``: one FP32 (NVFP4's product of the
    global scales, else 1); ``bias``: FP32 [N], read only with ``has_bias``. M and N need not be
    tile multiples: TMA zero-fills, the epilogue skips rows and columns past the edge. SFA / SFB:
    the 128x4 blocked layout of cuBLAS (``blockscaled_layout.tile_atom_to_shape_SF``):
    [L, ceil(M/128), K/vec/4, 32, 4, 4] bytes, padding rows included.

Structure (192 threads; a grid of at most one CTA per SM walks the output tiles, M fastest):
* warps 0-3, the epilogue: warp w reads TMEM lanes 32w..32w+31 (rows of the CTA's 128) once the
  accumulator pipeline (``PipelineUmmaAsync``) signals a tile's last MMA; 16-column slices are
  loaded (``tcgen05.ld.32x32b``, LDTM), scaled by alpha, the bias added, converted to D's dtype
  and stored straight to global memory; then the accumulator is released to the next tile.
* warp 4 (of the pair's leader CTA), the MMAs: per stage the scale factors go smem -> TMEM
  (``tcgen05.cp``, UTCCP), then 4 block-scaled MMAs accumulate into TMEM; ``tcgen05.commit``
  frees the stage (UTCBAR) in every CTA that loaded it.
* warp 5, the TMA loads of A, B, SFA, SFB into a ``PipelineTmaUmma`` ring, running ahead across
  tiles (a pair's 2-SM loads complete on the leader's barrier; two pairs per cluster share B
  multicast).
* TMEM columns: accumulator [0, tile_n), then SFA, then SFB; one accumulator buffer.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from .config import TILE_M, GemmConfig

_DTYPES = {  # element format -> (A/B dtype, scale-factor dtype)
    "mxf8": (cutlass.Float8E4M3FN, cutlass.Float8E8M0FNU),
    "mxf4": (cutlass.Float4E2M1FN, cutlass.Float8E8M0FNU),
    "nvf4": (cutlass.Float4E2M1FN, cutlass.Float8E4M3FN),
}
_OUT = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}
_THREADS = 128  # 4 warps: one per 32-lane quarter of TMEM
_EPI_N = 16  # accumulator columns per epilogue slice: 16 fp32 registers, one 32-byte bf16 store
_TMEM_ALLOC_BARRIER_ID = 1  # 0 is sync_threads
_EPILOGUE_BARRIER_ID = 2
# 4 epilogue warps (TMEM lane quarters), then the MMA warp and the TMA warp
_MMA_WARP, _TMA_WARP = 4, 5
_THREADS_WS = 6 * 32


def _one_stage(staged):
    return cute.slice_(staged, (None, None, None, 0))


def _tmem_columns(tile_n: int) -> int:
    """Columns to allocate: fp32 accumulator plus the scale factors' worst case (nvf4: 16 per row
    and K tile, 4 columns per 32 rows of SFA and of SFB, N rounded up to 128), rounded up to the
    power of two ``tcgen05.alloc`` takes."""
    used = tile_n + TILE_M // 32 * 4 + -(-tile_n // 128) * 128 // 32 * 4
    cols = 32
    while cols < used:
        cols *= 2
    return cols


class BlockScaledGemmSm100:
    def __init__(self, config: GemmConfig):
        self.config = config
        self.ab_dtype, self.sf_dtype = _DTYPES[config.element_format]
        self.sf_vec_size = config.sf_vec_size
        self.d_dtype = _OUT[config.out_dtype]
        self.has_bias = config.has_bias
        self.mma_tiler = (config.tile_m, config.tile_n, config.tile_k)
        self.num_stages = config.stages
        self.num_tmem_cols = _tmem_columns(config.tile_n)
        self.cta_group = config.cta_group
        self.pair = config.cta_group == 2
        self.pairs = config.cluster_pairs  # MMAs (CTAs or pairs) per cluster along M (they share B's loads)
        self.ctas_per_cluster = self.cta_group * self.pairs
        self.cluster_mn = (self.ctas_per_cluster, 1)
        # SFB: a 1-CTA MMA view of the CTA's rows and N rounded up to the 128-row SF atom
        self.mma_tiler_sfb = (TILE_M, -(-config.tile_n // 128) * 128, config.tile_k)

    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        sfa_ptr: cute.Pointer,
        sfb_ptr: cute.Pointer,
        d_ptr: cute.Pointer,
        alpha_ptr: cute.Pointer,
        bias_ptr: cute.Pointer,
        counts_ptr: cute.Pointer,
        m: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
        batch: cutlass.Int32,
        sm_count: cutlass.Int32,  # the persistent grid's bound: one CTA per SM
        stream,
    ):
        k_al = cute.assume(k, divby=self.config.tile_k)
        n_al = cute.assume(n, divby=16)
        mA = cute.make_tensor(a_ptr, cute.make_layout((m, k_al, batch), stride=(k_al, 1, m * k_al)))
        mB = cute.make_tensor(b_ptr, cute.make_layout((n, k_al, batch), stride=(k_al, 1, n * k_al)))
        mD = cute.make_tensor(d_ptr, cute.make_layout((m, n_al, batch), stride=(n_al, 1, m * n_al)))
        mAlpha = cute.make_tensor(alpha_ptr, cute.make_layout(1))
        mCounts = cute.make_tensor(counts_ptr, cute.make_layout(batch))  # read only when masked
        # bias[n] broadcast over m and l (zero strides): it tiles as D does
        mBias = cute.make_tensor(bias_ptr, cute.make_layout((m, n_al, batch), stride=(0, 1, 0)))
        mSFA = cute.make_tensor(sfa_ptr, blockscaled_utils.tile_atom_to_shape_SF(mA.shape, self.sf_vec_size))
        mSFB = cute.make_tensor(sfb_ptr, blockscaled_utils.tile_atom_to_shape_SF(mB.shape, self.sf_vec_size))

        self._launch(mA, mB, mSFA, mSFB, mD, mAlpha, mBias, mCounts, m, n, batch, sm_count, stream)

    @cute.jit
    def _launch(self, mA, mB, mSFA, mSFB, mD, mAlpha, mBias, mCounts, m, n, batch, sm_count, stream):
        """Host side: a persistent grid of at most ``sm_count`` CTAs (one per SM) in clusters of
        ``ctas_per_cluster`` walks the output tiles."""
        group = tcgen05.CtaGroup.TWO if cutlass.const_expr(self.pair) else tcgen05.CtaGroup.ONE
        tiled_mma = self._tiled_mma(group, self.mma_tiler[:2])
        tiled_mma_sfb = self._tiled_mma(tcgen05.CtaGroup.ONE, self.mma_tiler_sfb[:2])
        cluster_mn = self.cluster_mn
        cluster_vmnk = cute.tiled_divide(cute.make_layout((*cluster_mn, 1)), (tiled_mma.thr_id.shape,))
        cluster_sfb_vmnk = cute.tiled_divide(cute.make_layout((*cluster_mn, 1)), (tiled_mma_sfb.thr_id.shape,))
        sA_staged, sB_staged, sSFA_staged, sSFB_staged = self._staged_layouts(tiled_mma)

        op_a = sm100_utils.cluster_shape_to_tma_atom_A(cluster_mn, tiled_mma.thr_id)
        op_b = sm100_utils.cluster_shape_to_tma_atom_B(cluster_mn, tiled_mma.thr_id)
        op_sfb = sm100_utils.cluster_shape_to_tma_atom_SFB(cluster_mn, tiled_mma.thr_id)
        tma_a = cute.nvgpu.make_tiled_tma_atom_A(
            op_a, mA, _one_stage(sA_staged), self.mma_tiler, tiled_mma, cluster_vmnk.shape)
        tma_b = cute.nvgpu.make_tiled_tma_atom_B(
            op_b, mB, _one_stage(sB_staged), self.mma_tiler, tiled_mma, cluster_vmnk.shape)
        # scale factors travel as 16-bit TMA elements (a box row of 1-byte SFs is too narrow)
        tma_sfa = cute.nvgpu.make_tiled_tma_atom_A(
            op_a, mSFA, _one_stage(sSFA_staged), self.mma_tiler, tiled_mma, cluster_vmnk.shape,
            internal_type=cutlass.Int16)
        tma_sfb = cute.nvgpu.make_tiled_tma_atom_B(
            op_sfb, mSFB, _one_stage(sSFB_staged), self.mma_tiler_sfb, tiled_mma_sfb, cluster_sfb_vmnk.shape,
            internal_type=cutlass.Int16)
        # the (leader's) full barrier counts every CTA of the MMA's bytes
        tx_bytes = self.cta_group * self._stage_bytes(sA_staged, sB_staged, sSFA_staged, sSFB_staged)
        tiles = cute.ceil_div(m, self.mma_tiler[0] * self.pairs) * cute.ceil_div(n, self.config.tile_n) * batch
        clusters = cutlass.min(tiles, sm_count // self.ctas_per_cluster)
        self.kernel(
            tiled_mma, tiled_mma_sfb, *tma_a, *tma_b, *tma_sfa, *tma_sfb, mD, mAlpha, mBias, mCounts, cluster_vmnk,
            cluster_sfb_vmnk, sA_staged, sB_staged, sSFA_staged, sSFB_staged, tx_bytes,
        ).launch(grid=(clusters * self.ctas_per_cluster, 1, 1), block=[_THREADS_WS, 1, 1],
                 cluster=(*cluster_mn, 1), stream=stream)

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tiled_mma_sfb: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_atom_sfa: cute.CopyAtom,
        mSFA: cute.Tensor,
        tma_atom_sfb: cute.CopyAtom,
        mSFB: cute.Tensor,
        mD: cute.Tensor,
        mAlpha: cute.Tensor,
        mBias: cute.Tensor,
        mCounts: cute.Tensor,
        cluster_vmnk: cute.Layout,
        cluster_sfb_vmnk: cute.Layout,
        sA_staged: cute.ComposedLayout,
        sB_staged: cute.ComposedLayout,
        sSFA_staged: cute.Layout,
        sSFB_staged: cute.Layout,
        tx_bytes: cutlass.Constexpr,
    ):
        """Persistent and warp-specialized: cluster c of the grid takes output tiles c, c + clusters,
        ... (M fastest). Per CTA: warps 0-3 store its 128 rows of each tile from its TMEM, warp
        _MMA_WARP (of the pair's leader, v = 0) moves the scale factors to TMEM and issues the MMAs
        (their commits free the stages of every CTA that loaded them), warp _TMA_WARP loads the
        CTA's part of every stage (a pair's 2-SM TMA completes on the leader's barrier). One
        accumulator buffer: a tile's MMAs wait for the previous tile's stores, its loads run ahead.
        Masked (grouped) launches: an M tile past its batch's row count runs no K loop and stores
        nothing (the commit of zero MMAs releases the epilogue at once)."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        v = bidx % self.cta_group
        is_leader = v == 0
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        coord_vmnk = cluster_vmnk.get_flat_coord(rank)
        coord_sfb_vmnk = cluster_sfb_vmnk.get_flat_coord(rank)

        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            acc_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_dealloc_mbar: cutlass.Int64
            tmem_base: cutlass.Int32

        smem = SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sA, sB, sSFA, sSFB = self._alloc_operands(smem, sA_staged, sB_staged, sSFA_staged, sSFB_staged)

        one = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # a stage is free once every MMA issuer whose MMAs read it (B multicast: all pairs) committed
        ab_pipe = pipeline.PipelineTmaUmma.create(
            num_stages=self.num_stages, producer_group=one,
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.pairs), tx_count=tx_bytes,
            barrier_storage=storage.ab_mbar.data_ptr(), cta_layout_vmnk=cluster_vmnk, defer_sync=True,
        )
        # the epilogue warps of every CTA of the MMA consume the accumulator
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            num_stages=1, producer_group=one,
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.cta_group * _THREADS),
            barrier_storage=storage.acc_mbar.data_ptr(), cta_layout_vmnk=cluster_vmnk, defer_sync=True,
        )
        # the epilogue warps allocate; the MMA warp retrieves the address too
        retrieve = pipeline.NamedBarrier(barrier_id=_TMEM_ALLOC_BARRIER_ID, num_threads=_THREADS + 32)
        if cutlass.const_expr(self.pair):
            tmem = TmemAllocator(storage.tmem_base.ptr, barrier_for_retrieve=retrieve, is_two_cta=True,
                                 two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr)
        else:
            tmem = TmemAllocator(storage.tmem_base.ptr, barrier_for_retrieve=retrieve)
        pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)

        # (bM|bN, bK, RestM|RestN, RestK, RestL) views; a tile's slices are taken in the loops
        tiler_mk = cute.slice_(self.mma_tiler, (None, 0, None))
        tiler_nk = cute.slice_(self.mma_tiler, (0, None, None))
        tiler_sfb_nk = cute.slice_(self.mma_tiler_sfb, (0, None, None))
        gA = cute.local_tile(mA, tiler_mk, (None, None, None))
        gB = cute.local_tile(mB, tiler_nk, (None, None, None))
        gSFA = cute.local_tile(mSFA, tiler_mk, (None, None, None))
        gSFB = cute.local_tile(mSFB, tiler_sfb_nk, (None, None, None))
        thr_mma = tiled_mma.get_slice(v)
        thr_mma_sfb = tiled_mma_sfb.get_slice(v)
        k_tiles = cute.size(gA, mode=[3])
        # cluster tiles: ``pairs`` M tiles of one N column; this pair takes M tile ``tm * pairs + p``
        tiles_m = cute.ceil_div(cute.size(gA, mode=[2]), self.pairs)
        tiles_n = cute.ceil_div(mD.shape[1], self.config.tile_n)
        tiles = tiles_m * tiles_n * cute.size(gA, mode=[4])
        clusters = cute.arch.grid_dim()[0] // self.ctas_per_cluster
        first = bidx // self.ctas_per_cluster
        p = (bidx // self.cta_group) % self.pairs

        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        acc_layout = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(self.mma_tiler[:2])).layout
        pipeline_init_wait(cluster_shape_mn=self.cluster_mn)

        if warp_idx == _TMA_WARP:  # every CTA: its part of every stage
            a_layout = cute.make_layout(cute.slice_(cluster_vmnk, (0, 0, None, 0)).shape)
            b_layout = cute.make_layout(cute.slice_(cluster_vmnk, (0, None, 0, 0)).shape)
            sfb_layout = cute.make_layout(cute.slice_(cluster_sfb_vmnk, (0, None, 0, 0)).shape)
            tAsA, tAgA = self._tma_partition(tma_atom_a, sA, thr_mma.partition_A(gA), coord_vmnk[2], a_layout)
            tBsB, tBgB = self._tma_partition(tma_atom_b, sB, thr_mma.partition_B(gB), coord_vmnk[1], b_layout)
            tAsSFA, tAgSFA = self._tma_partition(tma_atom_sfa, sSFA, thr_mma.partition_A(gSFA), coord_vmnk[2],
                                                 a_layout)
            tBsSFB, tBgSFB = self._tma_partition(tma_atom_sfb, sSFB, thr_mma_sfb.partition_B(gSFB),
                                                 coord_sfb_vmnk[1], sfb_layout)
            # SF views repeat each byte over its vector: drop those zero strides for the copies
            tAsSFA, tAgSFA = cute.filter_zeros(tAsSFA), cute.filter_zeros(tAgSFA)
            tBsSFB, tBgSFB = cute.filter_zeros(tBsSFB), cute.filter_zeros(tBgSFB)
            masks = ({}, {}, {}, {})  # per copy of A, B, SFA, SFB
            if cutlass.const_expr(self.pair):
                # the 2-SM loads complete on the leader's barrier: the masks name the CTAs it counts
                mask_a = cpasync.create_tma_multicast_mask(cluster_vmnk, coord_vmnk, mcast_mode=2)
                mask_b = cpasync.create_tma_multicast_mask(cluster_vmnk, coord_vmnk, mcast_mode=1)
                mask_sfb = cpasync.create_tma_multicast_mask(cluster_sfb_vmnk, coord_sfb_vmnk, mcast_mode=1)
                masks = ({"mcast_mask": mask_a}, {"mcast_mask": mask_b}, {"mcast_mask": mask_a},
                         {"mcast_mask": mask_sfb})
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
            for t in cutlass.range(first, tiles, clusters, unroll=1):
                tm, tn, tl = self._tile_coord(t, tiles_m, tiles_n)
                tm = tm * self.pairs + p
                for k_tile in cutlass.range(self._k_count(mCounts, tm, tl, k_tiles), unroll=1):
                    ab_pipe.producer_acquire(state)
                    bar = ab_pipe.producer_get_barrier(state)
                    cute.copy(tma_atom_a, tAgA[(None, tm, k_tile, tl)], tAsA[(None, state.index)], tma_bar_ptr=bar,
                              **masks[0])
                    cute.copy(tma_atom_b, tBgB[(None, tn, k_tile, tl)], tBsB[(None, state.index)], tma_bar_ptr=bar,
                              **masks[1])
                    cute.copy(tma_atom_sfa, tAgSFA[(None, tm, k_tile, tl)], tAsSFA[(None, state.index)],
                              tma_bar_ptr=bar, **masks[2])
                    cute.copy(tma_atom_sfb, tBgSFB[(None, tn, k_tile, tl)], tBsSFB[(None, state.index)],
                              tma_bar_ptr=bar, **masks[3])
                    state.advance()
            # the (leader's) MMAs still read this CTA's stages: wait until they are all released
            ab_pipe.producer_tail(state)
        if warp_idx == _MMA_WARP:
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(cutlass.Float32)
            if is_leader:
                tCtAcc = cute.make_tensor(acc_ptr, acc_layout)
                tCtSFA, tCtSFB = self._sf_tmem(acc_ptr, tCtAcc, tiled_mma, sSFA_staged, sSFB_staged)
                s2t_sfa, tCsSFA_s2t, tCtSFA_s2t = self._s2t_partition(sSFA, tCtSFA)
                s2t_sfb, tCsSFB_s2t, tCtSFB_s2t = self._s2t_partition(sSFB, tCtSFB)
                acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
                for t in cutlass.range(first, tiles, clusters, unroll=1):
                    tm, tn, tl = self._tile_coord(t, tiles_m, tiles_n)
                    acc_pipe.producer_acquire(acc_state)  # the previous tile's rows are stored
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                    for _ in cutlass.range(self._k_count(mCounts, tm * self.pairs + p, tl, k_tiles), unroll=1):
                        ab_pipe.consumer_wait(read)
                        cute.copy(s2t_sfa, tCsSFA_s2t[(None, None, None, None, read.index)], tCtSFA_s2t)
                        cute.copy(s2t_sfb, tCsSFB_s2t[(None, None, None, None, read.index)], tCtSFB_s2t)
                        for kb in cutlass.range(cute.size(tCrA, mode=[2]), unroll_full=True):
                            tiled_mma.set(tcgen05.Field.SFA, tCtSFA[(None, None, kb)].iterator)
                            tiled_mma.set(tcgen05.Field.SFB, tCtSFB[(None, None, kb)].iterator)
                            cute.gemm(tiled_mma, tCtAcc, tCrA[(None, None, kb, read.index)],
                                      tCrB[(None, None, kb, read.index)], tCtAcc)
                            tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                        ab_pipe.consumer_release(read)  # commit to the empty barriers of the stage's loaders
                        read.advance()
                    acc_pipe.producer_commit(acc_state)  # commit to every CTA's accumulator barrier
                    acc_state.advance()
                acc_pipe.producer_tail(acc_state)
        if warp_idx < _MMA_WARP:  # the epilogue warps: TMEM lane quarters 0-3
            tmem.allocate(self.num_tmem_cols)
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(cutlass.Float32)
            tCtAcc = cute.make_tensor(acc_ptr, acc_layout)
            tiler_mn = cute.slice_(self.mma_tiler, (None, None, 0))
            alpha = mAlpha[0]
            acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            for t in cutlass.range(first, tiles, clusters, unroll=1):
                tm, tn, tl = self._tile_coord(t, tiles_m, tiles_n)
                tm = tm * self.pairs + p
                # this CTA's 128 rows of the MMA's output tile
                gD = thr_mma.partition_C(cute.local_tile(mD, tiler_mn, (tm, tn, tl)))[((None, None), 0, 0)]
                gBias = thr_mma.partition_C(cute.local_tile(mBias, tiler_mn, (tm, tn, tl)))[((None, None), 0, 0)]
                cD = thr_mma.partition_C(cute.local_tile(cute.make_identity_tensor(mD.shape), tiler_mn,
                                                         (tm, tn, tl)))[((None, None), 0, 0)]
                d_bound = mD.shape
                if cutlass.const_expr(self.config.masked):  # no row past this batch's count
                    d_bound = (mCounts[tl], mD.shape[1], mD.shape[2])
                acc_pipe.consumer_wait(acc_state)
                self._store_tile(tidx, tCtAcc, gD, cD, d_bound, alpha, gBias)
                cute.arch.fence_view_async_tmem_load()  # the loads are done before the MMAs may overwrite
                acc_pipe.consumer_release(acc_state)
                acc_state.advance()
            tmem.relinquish_alloc_permit()
            pipeline.NamedBarrier(barrier_id=_EPILOGUE_BARRIER_ID, num_threads=_THREADS).arrive_and_wait()
            tmem.free(acc_ptr)

    @cute.jit
    def _k_count(self, mCounts, tm, tl, k_tiles):
        """K tiles of output tile (tm, ·, tl): none for an M tile past its batch's count (masked)."""
        if cutlass.const_expr(self.config.masked):
            return cutlass.select_(tm * TILE_M < mCounts[tl], k_tiles, 0)
        return k_tiles

    @cute.jit
    def _tile_coord(self, t, tiles_m, tiles_n):
        """(m, n, l) of linear output tile ``t``, M fastest: clusters in flight share B's columns."""
        rest = t // tiles_m
        return t % tiles_m, rest % tiles_n, rest // tiles_n

    # ------------------------------------------------------------------ shared pieces
    def _tiled_mma(self, group, tiler_mn):
        return sm100_utils.make_blockscaled_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, OperandMajorMode.K, OperandMajorMode.K, self.sf_dtype, self.sf_vec_size,
            group, tiler_mn,
        )

    def _staged_layouts(self, tiled_mma):
        """The ``num_stages``-deep shared-memory layouts of A, B, SFA, SFB."""
        stages = self.num_stages
        return (sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, self.ab_dtype, stages),
                sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, self.ab_dtype, stages),
                blockscaled_utils.make_smem_layout_sfa(tiled_mma, self.mma_tiler, self.sf_vec_size, stages),
                blockscaled_utils.make_smem_layout_sfb(tiled_mma, self.mma_tiler, self.sf_vec_size, stages))

    def _stage_bytes(self, sA_staged, sB_staged, sSFA_staged, sSFB_staged):
        """Bytes one CTA's TMA writes into one stage."""
        return (cute.size_in_bytes(self.ab_dtype, _one_stage(sA_staged))
                + cute.size_in_bytes(self.ab_dtype, _one_stage(sB_staged))
                + cute.size_in_bytes(self.sf_dtype, _one_stage(sSFA_staged))
                + cute.size_in_bytes(self.sf_dtype, _one_stage(sSFB_staged)))

    def _alloc_operands(self, smem, sA_staged, sB_staged, sSFA_staged, sSFB_staged):
        return (smem.allocate_tensor(self.ab_dtype, sA_staged.outer, byte_alignment=128, swizzle=sA_staged.inner),
                smem.allocate_tensor(self.ab_dtype, sB_staged.outer, byte_alignment=128, swizzle=sB_staged.inner),
                smem.allocate_tensor(self.sf_dtype, sSFA_staged, byte_alignment=128),
                smem.allocate_tensor(self.sf_dtype, sSFB_staged, byte_alignment=128))

    @cute.jit
    def _sf_tmem(self, acc_ptr, tCtAcc, tiled_mma, sSFA_staged, sSFB_staged):
        """The scale factors' TMEM tensors, in the columns after the accumulator: SFA, then SFB."""
        sfa_col = tcgen05.find_tmem_tensor_col_offset(tCtAcc)
        tCtSFA = cute.make_tensor(
            cute.recast_ptr(acc_ptr + sfa_col, dtype=self.sf_dtype),
            blockscaled_utils.make_tmem_layout_sfa(tiled_mma, self.mma_tiler, self.sf_vec_size,
                                                   _one_stage(sSFA_staged)),
        )
        sfb_col = sfa_col + tcgen05.find_tmem_tensor_col_offset(tCtSFA)
        tCtSFB = cute.make_tensor(
            cute.recast_ptr(acc_ptr + sfb_col, dtype=self.sf_dtype),
            blockscaled_utils.make_tmem_layout_sfb(tiled_mma, self.mma_tiler, self.sf_vec_size,
                                                   _one_stage(sSFB_staged)),
        )
        return tCtSFA, tCtSFB

    @cute.jit
    def _tma_partition(self, atom: cute.CopyAtom, sX: cute.Tensor, tCgX: cute.Tensor, cta_coord=0, cta_layout=None):
        """(smem, gmem) views of one operand for its TMA atom (default: one CTA, no multicast)."""
        layout = cute.make_layout(1) if cutlass.const_expr(cta_layout is None) else cta_layout
        return cpasync.tma_partition(atom, cta_coord, layout, cute.group_modes(sX, 0, 3),
                                     cute.group_modes(tCgX, 0, 3))

    @cute.jit
    def _s2t_partition(self, sSF: cute.Tensor, tCtSF: cute.Tensor):
        """``tcgen05.cp`` of one stage of scale factors: (tiled copy, smem descriptors with a
        STAGE mode, TMEM destination)."""
        group = tcgen05.CtaGroup.TWO if cutlass.const_expr(self.pair) else tcgen05.CtaGroup.ONE
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(group), self.sf_dtype)
        tCtSF_compact = cute.filter_zeros(tCtSF)
        tiled = tcgen05.make_s2t_copy(atom, tCtSF_compact)
        thr = tiled.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(tiled, thr.partition_S(cute.filter_zeros(sSF)))
        return tiled, src, thr.partition_D(tCtSF_compact)

    @cute.jit
    def _store_tile(self, tidx, tCtAcc: cute.Tensor, gD: cute.Tensor, cD: cute.Tensor, d_shape, alpha,
                    gBias: cute.Tensor):
        """The CTA's 128 accumulator rows (TMEM lanes) -> ``alpha * acc (+ bias)`` -> D."""
        epi_tile = (TILE_M, _EPI_N)
        tAcc_epi = cute.flat_divide(tCtAcc[((None, None), 0, 0)], epi_tile)  # (128, _EPI_N, 1, tile_n / _EPI_N)
        gD_epi = cute.flat_divide(gD, epi_tile)
        cD_epi = cute.flat_divide(cD, epi_tile)
        gBias_epi = cute.flat_divide(gBias, epi_tile)
        load = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x16, tcgen05.Pack.NONE), cutlass.Float32)
        t2r = tcgen05.make_tmem_copy(load, tAcc_epi[(None, None, 0, 0)])
        thr = t2r.get_slice(tidx)
        tTR_tAcc = thr.partition_S(tAcc_epi)
        tTR_gD = thr.partition_D(gD_epi)
        tTR_cD = thr.partition_D(cD_epi)
        tTR_gBias = thr.partition_D(gBias_epi)
        rAcc = cute.make_rmem_tensor(tTR_gD[(None, None, None, 0, 0)].shape, cutlass.Float32)
        rBias = cute.make_rmem_tensor(rAcc.shape, cutlass.Float32)
        rD = cute.make_rmem_tensor(rAcc.shape, self.d_dtype)
        store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.d_dtype)
        for i in cutlass.range(cute.size(tTR_tAcc, mode=[4]), unroll_full=True):
            cute.copy(t2r, tTR_tAcc[(None, None, None, 0, i)], rAcc)
            # a thread's slice is one row and _EPI_N columns that N (a multiple of _EPI_N) holds whole
            if cute.elem_less(tTR_cD[(None, None, None, 0, i)][0], d_shape):
                out = rAcc.load() * alpha
                if cutlass.const_expr(self.has_bias):
                    cute.autovec_copy(tTR_gBias[(None, None, None, 0, i)], rBias)
                    out = out + rBias.load()
                rD.store(out.to(self.d_dtype))
                cute.copy(store, rD, tTR_gD[(None, None, None, 0, i)])
