"""Hopper (sm_90a) FP8 block-scaled GEMM in CuTe DSL.

    D[m, n] = sum_kb (A[m, kb-block] . B[n, kb-block]) * sa[m, kb] * sb[n-scale, kb]  (+ bias[n])

A: E4M3 [M, K] K-major with 1x128 scales ``sa`` [M, ceil(K/128)] (fp32, MN-major: stride (1, ld),
ld a multiple of 4). B: E4M3 [N, K] K-major with either 128x128 scales ``sb``
[ceil(N/128), ceil(K/128)] ("block" kind) or 1x128 scales [N, ceil(K/128)] ("col" kind).

Structure (DeepGEMM-style promotion, warp specialised, persistent):

* warpgroup 0 (producer, ``setmaxnreg`` 40; 24 with 1x128 B scales and a bias): one warp
  issues, per stage of a multi-stage shared-memory ring, the TMA loads of one 128-wide K
  block: the A and B tiles (optionally multicast across a cluster) and their scales (the
  tile's A row scales; its B column scales or 128x128 block scales).
* warpgroups 1..2 (consumers, ``setmaxnreg`` 232; 240 with 1x128 B scales and a bias): each
  owns 64 rows of the CTA tile. For every K block: ``wgmma`` into a *fresh* register
  accumulator (ACCUMULATE off on the first instruction), the block's scales copied from the
  stage to registers, then promotion
  ``acc += blk * (sa[row] * sb[col])`` in FP32 registers. With ``mma_overlap`` (tile_n <= 128)
  two block accumulators alternate, so the wgmma batch of block k+1 runs while block k is
  promoted (``wait_group(1)``, operands pinned by ``fence_operand``); otherwise each block is
  waited for (``wait_group(0)``). 1x128 B scales on tiles over 64 columns are read from the
  stage at promotion instead (``sb_from_smem``, ``_retire``), so that ``blk2`` fits. Tiles wider
  than 128 columns that can straddle two 128-wide scale blocks get one copy of the K loop per
  possible split column, so each column group's scale block is known when tracing (``_mainloop``).
* epilogue: optional bias, conversion, ``stmatrix`` to shared memory, TMA store (16-bit outputs
  staged whole, one barrier pair per tile; fp32 through two buffers, a pair per slice); grouped
  tiles that end inside the output store row by row from registers.
* schedules (``grouping``): None — static persistent scheduler over (M tiles, N tiles, K
  splits), grid = #SMs / cluster size, 2-CTA clusters multicast the shared operand, split-K
  writes fp32 partials; "contiguous" / "masked" / "kgrouped" — the MoE grouped GEMMs, tiles from
  a walk over the groups that reads their sizes on the device (see ``_group_info``).

Pieces shared by the schedules: ``_producer_mainloop`` / ``_producer_grouped`` (TMA ring),
``_mainloop`` (K blocks with promotion), ``_issue_kblock``, ``_retire``, ``_promote``, ``fence_operand``,
``_epilogue_tma``, ``_epilogue_direct``.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.memory import SmemAllocator
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from .config import SCALE_BLOCK, TileConfig, scale_blocks_spanned, valid_tile_n  # noqa: F401  (re-exported)

SMEM_CAPACITY_SM90 = 232448  # bytes of dynamic smem per CTA on sm_90
_SB_BOX_K = 4  # K blocks per TMA box of 128x128 B scales (16 bytes: the smallest TMA box row)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dsl_user_op
def _pin_f32(x, *, loc=None, ip=None):
    """Empty volatile asm ``"=f,0"`` on one fp32 value: the compiler may not move reads of the
    value across it (CUTLASS's ``warpgroup_fence_operand``)."""
    v = llvm.inline_asm(
        cutlass.Float32.mlir_type,
        [cutlass.Float32(x).ir_value(loc=loc, ip=ip)],
        "",
        "=f,0",
        has_side_effects=True,
        loc=loc,
        ip=ip,
    )
    return cutlass.Float32(v)


@cute.jit
def fence_operand(t: cute.Tensor):
    """Pin every register of an accumulator fragment (see ``_pin_f32``)."""
    for i in cutlass.range_constexpr(cute.size(t)):
        t[i] = _pin_f32(t[i])


class BlockScaledGemmSm90:
    """Persistent warp-specialised FP8 block-scaled GEMM for sm_90a.

    :param config: tile configuration
    :param out_dtype: cutlass.BFloat16 / cutlass.Float16 / cutlass.Float32
    :param b_scale_per_col: False -> 128x128 weight scales; True -> 1x128 per-row-of-B scales
    :param bias_dtype: None (no bias) or cutlass.Float32 / cutlass.BFloat16
    :param num_sms: number of SMs of the target GPU (persistent grid size), a compile constant
    """

    def __init__(
        self,
        config: TileConfig,
        out_dtype: type[cutlass.Numeric],
        b_scale_per_col: bool,
        bias_dtype: type[cutlass.Numeric] | None,
        num_sms: int,
        grouping: str | None = None,
    ):
        if config.tile_m not in (64, 128):
            raise ValueError(f"tile_m must be 64 or 128, got {config.tile_m}")
        if not valid_tile_n(config.tile_n):
            raise ValueError(f"unsupported tile_n {config.tile_n}")
        self.config = config
        self.out_dtype = out_dtype
        self.b_scale_per_col = b_scale_per_col
        self.bias_dtype = bias_dtype
        self.num_sms = num_sms
        # None: one GEMM; "contiguous" / "masked": one GEMM per group of A's rows against B[e]
        # (128x128 B scales); "kgrouped": one GEMM per group of K blocks, D[e] = A[:, Ke] B[:, Ke]^T
        # (weight gradients, 1x128 B scales). See _group_info. No bias or split-K; clusters only
        # along N (the two CTAs take neighbouring N tiles of one M tile: A multicast).
        if grouping not in (None, "contiguous", "masked", "kgrouped"):
            raise ValueError(
                f"grouping must be None, 'contiguous', 'masked' or 'kgrouped', got {grouping!r}"
            )
        if grouping is not None and (
            b_scale_per_col != (grouping == "kgrouped") or bias_dtype is not None
            or config.split_k > 1 or config.cluster_m != 1 or config.cluster_n not in (1, 2)
        ):
            raise ValueError(
                "grouped GEMM: no bias, split_k 1, cluster 1x1 or 1x2; 1x128 B scales exactly for "
                "kgrouped"
            )
        self.grouping = grouping
        self.split_k = config.split_k
        # a second block accumulator (tile_n/2 registers) must fit next to acc and blk
        self.overlap = config.mma_overlap and config.tile_n <= 128
        # 1x128 B scales with two block accumulators: the tile_n/4 column scales are read from the
        # stage at promotion time (the stage is released after it) instead of being held in
        # registers from the issue on, which leaves no room for blk2 above 64 columns
        self.sb_from_smem = b_scale_per_col and self.overlap and config.tile_n > 64

        self.acc_dtype = cutlass.Float32
        self.ab_dtype = cutlass.Float8E4M3FN
        self.tile_m, self.tile_n, self.tile_k = config.tile_m, config.tile_n, SCALE_BLOCK
        # grouped tiles start at any row, but a TMA box of A scales must start 16-byte aligned:
        # load from the row rounded down to a multiple of 4, with 4 extra rows
        self.sa_box_m = self.tile_m + (4 if grouping is not None else 0)
        self.cluster_shape_mn = (config.cluster_m, config.cluster_n)
        self.num_mma_wg = self.tile_m // 64
        self.atom_layout_mnk = (self.num_mma_wg, 1, 1)
        self.threads_per_wg = 128
        self.threads_per_cta = (1 + self.num_mma_wg) * self.threads_per_wg
        self.num_mma_threads = self.num_mma_wg * self.threads_per_wg
        self.load_warp_id = 0
        self.epi_store_warp_id = 4  # first warp of the first consumer warpgroup
        # 1x128 B scales with a bias: the consumers need 8 more registers (232 left 23 LDL/STL
        # in 128x128 c2x1); 128 * 24 + 256 * 240 still fits the 64K register file
        # (NOTES, session 11)
        wide = b_scale_per_col and bias_dtype is not None
        self.load_regs = 24 if wide else 40
        self.mma_regs = 240 if wide else 232
        self.buffer_align_bytes = 1024
        self.num_mcast_ctas_a = config.cluster_n
        self.num_mcast_ctas_b = config.cluster_m
        self.is_a_mcast = self.num_mcast_ctas_a > 1
        self.is_b_mcast = self.num_mcast_ctas_b > 1
        # the 128x128-scale kind: can a tile straddle two scale blocks along N?
        self.n_straddle = not (SCALE_BLOCK % self.tile_n == 0 or self.tile_n % SCALE_BLOCK == 0)
        self.epilog_sync_barrier = pipeline.NamedBarrier(
            barrier_id=1, num_threads=self.num_mma_threads
        )

    # ------------------------------------------------------------------ host side
    def _make_tiled_mma(self):
        return sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K,
            self.acc_dtype,
            self.atom_layout_mnk,
            tiler_mn=(64, self.tile_n),
        )

    def _setup_attributes(self):
        self.tiled_mma = self._make_tiled_mma()
        self.tile_shape_mnk = (self.tile_m, self.tile_n, self.tile_k)
        self.cta_layout_mnk = cute.make_layout((*self.cluster_shape_mn, 1))

        epi_n = 32 if self.tile_n % 32 == 0 else 16
        self.epi_tile = (self.tile_m, epi_n)
        # 16-bit out: 4 buffers hold a tile up to 128 wide, wider tiles get one per slice: one
        # barrier pair per tile (_epilogue_tma; 2 buffers and a 6th A/B stage measured 3-15%
        # slower, NOTES v7; 128x160 +14% with 5, session 13). 80/112-wide tiles (16-column
        # slices) keep 4: more buffers there are unmeasured.
        if self.out_dtype.width != 16:
            self.epi_stage = 2
        elif self.tile_n > 128:
            self.epi_stage = self.tile_n // epi_n
        else:
            self.epi_stage = 4
        self.d_layout = LayoutEnum.ROW_MAJOR

        # scales ride in the same pipeline stage as their K block (TMA, 128-byte aligned slots):
        # A: tile_m row scales; B: tile_n column scales (1x128) or one 4-wide box of the
        # [NB, KB] grid per 128-column block the tile touches (128x128)
        self.sb_box = (self.tile_n, 1) if self.b_scale_per_col else (1, _SB_BOX_K)
        self.num_sb_boxes = 1 if self.b_scale_per_col else scale_blocks_spanned(self.tile_n)
        scale_bytes_per_stage = 4 * (
            _round_up(self.sa_box_m, 32) + self.num_sb_boxes * _round_up(self.sb_box[0] * self.sb_box[1], 32)
        )
        ab_bytes_per_stage = (
            (self.tile_m + self.tile_n) * self.tile_k * self.ab_dtype.width // 8 + scale_bytes_per_stage
        )
        epi_bytes = self.tile_m * epi_n * self.out_dtype.width // 8 * self.epi_stage
        self.ab_stage = min(
            12, (SMEM_CAPACITY_SM90 - 2048 - epi_bytes) // ab_bytes_per_stage
        )

        a_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.ab_dtype, self.tile_k),
            self.ab_dtype,
        )
        self.a_smem_layout_staged = cute.tile_to_shape(
            a_atom, (self.tile_m, self.tile_k, self.ab_stage), order=(0, 1, 2)
        )
        b_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.ab_dtype, self.tile_k),
            self.ab_dtype,
        )
        self.b_smem_layout_staged = cute.tile_to_shape(
            b_atom, (self.tile_n, self.tile_k, self.ab_stage), order=(0, 1, 2)
        )
        self.epi_smem_layout_staged = sm90_utils.make_smem_layout_epi(
            self.out_dtype, self.d_layout, self.epi_tile, self.epi_stage
        )
        self.sa_smem_layout_staged, self.sb_smem_layout_staged = self._scale_smem_layouts()

    def _scale_smem_layouts(self):
        """(A-scale, B-scale) staged smem layouts; built again inside the kernel (layouts made
        on the host side may not be captured by the kernel region)."""
        sa = cute.make_layout(
            (self.sa_box_m, 1, self.ab_stage), stride=(1, 1, _round_up(self.sa_box_m, 32))
        )
        sb_slot = _round_up(self.sb_box[0] * self.sb_box[1], 32)
        sb = cute.make_layout((*self.sb_box, self.ab_stage), stride=(self.sb_box[1], 1, sb_slot))
        return sa, sb

    def _sb_box_floats(self) -> int:
        """smem floats of one staged B-scale box buffer (a multiple of 32: 128-byte aligned)"""
        return _round_up(self.sb_box[0] * self.sb_box[1], 32) * self.ab_stage

    @cute.jit
    def __call__(
        self,
        mA_u8: cute.Tensor,  # (M, K) uint8 view of E4M3, K-major
        mB_u8: cute.Tensor,  # (N, K) uint8 view of E4M3, K-major
        mD: cute.Tensor,  # (M, N) out dtype, N-major
        mSA: cute.Tensor,  # (M, KB) fp32
        mSB: cute.Tensor,  # (NB, KB) or (N, KB) fp32
        mBias: cute.Tensor,  # (N,) fp32/bf16 (ignored when bias_dtype is None)
        mGroup: cute.Tensor,  # (E,) int32 group ends / counts (grouped only)
        m_max: cutlass.Int32,  # rows per group of the masked layout
        stream,
    ):
        mA = cute.make_tensor(cute.recast_ptr(mA_u8.iterator, dtype=self.ab_dtype), mA_u8.layout)
        mB = cute.make_tensor(cute.recast_ptr(mB_u8.iterator, dtype=self.ab_dtype), mB_u8.layout)
        self._setup_attributes()

        a_op = (
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
            if self.is_a_mcast
            else cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        )
        tma_atom_a, tma_tensor_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
            a_op,
            mA,
            cute.slice_(self.a_smem_layout_staged, (None, None, 0)),
            (self.tile_m, self.tile_k),
            num_multicast=self.num_mcast_ctas_a,
        )
        b_op = (
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
            if self.is_b_mcast
            else cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        )
        tma_atom_b, tma_tensor_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
            b_op,
            mB,
            cute.slice_(self.b_smem_layout_staged, (None, None, 0)),
            (self.tile_n, self.tile_k),
            num_multicast=self.num_mcast_ctas_b,
        )
        # scales: every CTA loads its own (no multicast)
        tma_atom_sa, tma_tensor_sa = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
            mSA,
            cute.slice_(self.sa_smem_layout_staged, (None, None, 0)),
            (self.sa_box_m, 1),
        )
        tma_atom_sb, tma_tensor_sb = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
            mSB,
            cute.slice_(self.sb_smem_layout_staged, (None, None, 0)),
            self.sb_box,
        )
        tma_atom_d, tma_tensor_d = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
            mD,
            cute.slice_(self.epi_smem_layout_staged, (None, None, 0)),
            self.epi_tile,
        )

        m = cute.size(mD, mode=[0])
        n = cute.size(mD, mode=[1])
        num_tiles_mnl = (
            (m + self.tile_m - 1) // self.tile_m,
            (n + self.tile_n - 1) // self.tile_n,
            self.split_k,
        )
        tile_sched_params = utils.PersistentTileSchedulerParams(
            num_tiles_mnl,
            (*self.cluster_shape_mn, 1),
            self.config.swizzle,
            self.config.raster_along_m,
        )
        max_active_clusters = self.num_sms // (self.cluster_shape_mn[0] * self.cluster_shape_mn[1])
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(
            tile_sched_params, max_active_clusters
        )
        if cutlass.const_expr(self.grouping is not None):
            # tile count known on the device only; cluster id = block_idx z (see _walk_start)
            grid = (1, self.cluster_shape_mn[1], self.num_sms // self.cluster_shape_mn[1])

        @cute.struct
        class SharedStorage:
            mainloop_pipeline_array_ptr: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem_layout_staged)],
                self.buffer_align_bytes,
            ]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_smem_layout_staged)],
                self.buffer_align_bytes,
            ]
            sD: cute.struct.Align[
                cute.struct.MemRange[self.out_dtype, cute.cosize(self.epi_smem_layout_staged)],
                self.buffer_align_bytes,
            ]
            sSA: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float32, cute.cosize(self.sa_smem_layout_staged)],
                128,
            ]
            sSB: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float32, self._sb_box_floats() * self.num_sb_boxes],
                128,
            ]

        self.shared_storage = SharedStorage

        self.kernel(
            tma_atom_a,
            tma_tensor_a,
            tma_atom_b,
            tma_tensor_b,
            tma_atom_d,
            tma_tensor_d,
            tma_atom_sa,
            tma_tensor_sa,
            tma_atom_sb,
            tma_tensor_sb,
            mBias,
            mD,
            mGroup,
            m_max,
            self.tiled_mma,
            self.cta_layout_mnk,
            self.a_smem_layout_staged,
            self.b_smem_layout_staged,
            self.epi_smem_layout_staged,
            tile_sched_params,
        ).launch(
            grid=grid,
            block=[self.threads_per_cta, 1, 1],
            cluster=(*self.cluster_shape_mn, 1),
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=self.config.pdl,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_atom_d: cute.CopyAtom,
        mD: cute.Tensor,
        tma_atom_sa: cute.CopyAtom,
        mSA: cute.Tensor,
        tma_atom_sb: cute.CopyAtom,
        mSB: cute.Tensor,
        mBias: cute.Tensor,
        mD_raw: cute.Tensor,
        mGroup: cute.Tensor,
        m_max: cutlass.Int32,
        tiled_mma: cute.TiledMma,
        cta_layout_mnk: cute.Layout,
        a_smem_layout_staged: cute.ComposedLayout,
        b_smem_layout_staged: cute.ComposedLayout,
        epi_smem_layout_staged: cute.ComposedLayout,
        tile_sched_params: utils.PersistentTileSchedulerParams,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_d)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_sa)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_sb)

        cta_rank_in_cluster = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord_mnk = cta_layout_mnk.get_flat_coord(cta_rank_in_cluster)

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        a_smem_layout = cute.slice_(a_smem_layout_staged, (None, None, 0))
        b_smem_layout = cute.slice_(b_smem_layout_staged, (None, None, 0))
        tma_copy_bytes = (
            cute.size_in_bytes(self.ab_dtype, a_smem_layout)
            + cute.size_in_bytes(self.ab_dtype, b_smem_layout)
            + 4 * (self.sa_box_m + self.sb_box[0] * self.sb_box[1] * self.num_sb_boxes)
        )
        mcast_size = self.num_mcast_ctas_a + self.num_mcast_ctas_b - 1
        mainloop_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mainloop_pipeline_array_ptr.data_ptr(),
            num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, mcast_size * self.num_mma_wg * 4
            ),
            tx_count=tma_copy_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
            defer_sync=True,
        )
        pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_layout_staged.outer, swizzle=a_smem_layout_staged.inner)
        sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)
        sD = storage.sD.get_tensor(
            epi_smem_layout_staged.outer, swizzle=epi_smem_layout_staged.inner
        )
        sa_layout, sb_layout = self._scale_smem_layouts()
        sSA = storage.sSA.get_tensor(sa_layout)
        sSB = [
            cute.make_tensor(storage.sSB.data_ptr() + i * self._sb_box_floats(), sb_layout)
            for i in range(self.num_sb_boxes)
        ]

        # (BM, BK, #m tiles, #k tiles) etc.
        gA = cute.local_tile(mA, (self.tile_m, self.tile_k), (None, None))
        gB = cute.local_tile(mB, (self.tile_n, self.tile_k), (None, None))
        gSA = cute.local_tile(mSA, (self.tile_m, 1), (None, None))  # (BM, 1, #m tiles, KB)
        gSB = cute.local_tile(mSB, self.sb_box, (None, None))
        if cutlass.const_expr(self.split_k > 1):
            # mD is (M, N, split_k): (BM, BN, #m tiles, #n tiles, split_k)
            gD = cute.local_tile(mD, (self.tile_m, self.tile_n), (None, None, None))
        else:
            gD = cute.local_tile(mD, (self.tile_m, self.tile_n), (None, None))
        k_tile_cnt = cute.size(gA, mode=[3])  # all K blocks; a split handles a slice of them

        warp_group_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)

        pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)
        if cutlass.const_expr(self.config.pdl):
            # everything above is private to this CTA; from here on global memory is read and
            # written, so the previous grid must be done. Dependents may launch now: they only
            # fit on an SM once this CTA has left (it holds the register file and smem).
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()

        if warp_group_idx == 0:
            cute.arch.setmaxregister_decrease(self.load_regs)
            if cutlass.const_expr(self.grouping is not None):
                if warp_idx == self.load_warp_id:
                    self._producer_grouped(
                        tma_atom_a, tma_atom_b, tma_atom_sa, tma_atom_sb, mA, mB, mSA, gSB,
                        sA, sB, sSA, sSB, mainloop_pipeline, k_tile_cnt,
                        mGroup, cute.size(mD, mode=[0]), cute.size(mD, mode=[1]), m_max,
                        cta_layout_mnk, cluster_coord_mnk,
                    )
            else:
                if warp_idx == self.load_warp_id:
                    self._producer_mainloop(
                        tma_atom_a,
                        tma_atom_b,
                        tma_atom_sa,
                        tma_atom_sb,
                        gA,
                        gB,
                        gSA,
                        gSB,
                        sA,
                        sB,
                        sSA,
                        sSB,
                        mainloop_pipeline,
                        cta_layout_mnk,
                        cluster_coord_mnk,
                        k_tile_cnt,
                        tile_sched_params,
                    )
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self._consumer(
                tidx - self.threads_per_wg,
                warp_idx,
                tiled_mma,
                sA,
                sB,
                sD,
                gD,
                cute.size(mD, mode=[1]),
                tma_atom_d,
                sSA,
                sSB,
                mBias,
                mainloop_pipeline,
                k_tile_cnt,
                tile_sched_params,
                mD,
                mD_raw,
                mGroup,
                m_max,
            )

    # --- producer: TMA loads of A/B K-blocks into the smem ring -------------------------
    @cute.jit
    def _producer_mainloop(
        self,
        tma_atom_a: cute.CopyAtom,
        tma_atom_b: cute.CopyAtom,
        tma_atom_sa: cute.CopyAtom,
        tma_atom_sb: cute.CopyAtom,
        gA: cute.Tensor,
        gB: cute.Tensor,
        gSA: cute.Tensor,
        gSB: cute.Tensor,
        sA: cute.Tensor,
        sB: cute.Tensor,
        sSA: cute.Tensor,
        sSB: list,
        mainloop_pipeline: pipeline.PipelineTmaAsync,
        cta_layout_mnk: cute.Layout,
        cluster_coord_mnk,
        k_tile_cnt,
        tile_sched_params: utils.PersistentTileSchedulerParams,
    ):
        a_mcast_mask = 0
        b_mcast_mask = 0
        if cutlass.const_expr(self.is_a_mcast):
            a_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord_mnk, mode=1)
        if cutlass.const_expr(self.is_b_mcast):
            b_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord_mnk, mode=0)

        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_atom_a,
            cluster_coord_mnk[1],
            cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape),
            cute.group_modes(sA, 0, 2),
            cute.group_modes(gA, 0, 2),
        )
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_atom_b,
            cluster_coord_mnk[0],
            cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape),
            cute.group_modes(sB, 0, 2),
            cute.group_modes(gB, 0, 2),
        )
        tSAsSA, tSAgSA = cute.nvgpu.cpasync.tma_partition(
            tma_atom_sa, 0, cute.make_layout(1), cute.group_modes(sSA, 0, 2),
            cute.group_modes(gSA, 0, 2),
        )
        sb_parts = [
            cute.nvgpu.cpasync.tma_partition(
                tma_atom_sb, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                cute.group_modes(gSB, 0, 2),
            )
            for s in sSB
        ]
        nsb_rows = cute.size(gSB, mode=[2])

        tile_sched = utils.StaticPersistentTileScheduler.create(
            tile_sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
        )
        work_tile = tile_sched.initial_work_tile_info()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
        while work_tile.is_valid_tile:
            tile_coord = work_tile.tile_idx
            tAgA_m = tAgA[(None, tile_coord[0], None)]
            tBgB_n = tBgB[(None, tile_coord[1], None)]
            k_first, k_cnt = self._k_range(tile_coord, k_tile_cnt)
            tSAgSA_m = tSAgSA[(None, tile_coord[0], None)]
            if cutlass.const_expr(self.b_scale_per_col):
                sb_rows = [tile_coord[1]]
            else:
                nb0 = tile_coord[1] * self.tile_n // SCALE_BLOCK
                sb_rows = [cutlass.min(nb0 + i, nsb_rows - 1) for i in range(self.num_sb_boxes)]
            for k_tile in range(k_cnt):
                mainloop_pipeline.producer_acquire(state)
                bar = mainloop_pipeline.producer_get_barrier(state)
                k = k_first + k_tile
                cute.copy(
                    tma_atom_sa, tSAgSA_m[(None, k)], tSAsSA[(None, state.index)], tma_bar_ptr=bar
                )
                for i in cutlass.range_constexpr(self.num_sb_boxes):
                    tSBsSB, tSBgSB = sb_parts[i]
                    if cutlass.const_expr(self.b_scale_per_col):
                        src = tSBgSB[(None, sb_rows[i], k)]
                    else:
                        src = tSBgSB[(None, sb_rows[i], k // _SB_BOX_K)]
                    cute.copy(tma_atom_sb, src, tSBsSB[(None, state.index)], tma_bar_ptr=bar)
                cute.copy(
                    tma_atom_a,
                    tAgA_m[(None, k)],
                    tAsA[(None, state.index)],
                    tma_bar_ptr=bar,
                    mcast_mask=a_mcast_mask,
                )
                cute.copy(
                    tma_atom_b,
                    tBgB_n[(None, k)],
                    tBsB[(None, state.index)],
                    tma_bar_ptr=bar,
                    mcast_mask=b_mcast_mask,
                )
                mainloop_pipeline.producer_commit(state)
                state.advance()
            tile_sched.advance_to_next_work()
            work_tile = tile_sched.get_current_work()
        mainloop_pipeline.producer_tail(state)

    # --- producer of the grouped GEMM: same ring, tiles from the group walk ---------------
    @cute.jit
    def _producer_grouped(
        self, tma_atom_a, tma_atom_b, tma_atom_sa, tma_atom_sb, mA, mB, mSA, gSB,
        sA, sB, sSA, sSB, mainloop_pipeline, k_tile_cnt, mGroup, m_size, n_size, m_max,
        cta_layout_mnk, cluster_coord_mnk,
    ):
        a_mcast_mask = 0
        if cutlass.const_expr(self.is_a_mcast):
            a_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord_mnk, mode=1)
        a_cta_layout = cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape)
        tiles_n = (n_size + self.tile_n - 1) // self.tile_n
        walk_n = tiles_n // self.cluster_shape_mn[1]
        nb_per_group = (n_size + SCALE_BLOCK - 1) // SCALE_BLOCK
        sb_parts = [
            cute.nvgpu.cpasync.tma_partition(
                tma_atom_sb, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                cute.group_modes(gSB, 0, 2),
            )
            for s in sSB
        ]
        n_groups = self._num_groups(mGroup)
        t, step, rank_n = self._walk_start()
        e = cutlass.Int32(0)
        base = cutlass.Int32(0)
        g_start, g_rows, g_live = self._group_info(mGroup, e, m_size, m_max)
        g_tiles_m = (g_rows + self.tile_m - 1) // self.tile_m
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
        while e < n_groups:
            if t < base + g_tiles_m * walk_n:
                local = t - base
                m_tile = local % g_tiles_m
                n_tile = (local // g_tiles_m) * self.cluster_shape_mn[1] + rank_n
                off = self._tile_offset(g_rows, m_tile)
                row0 = g_start + off
                k_first, k_cnt = self._tile_k_range(mGroup, e, k_tile_cnt, g_live - off)
                a_row = row0
                b_row = e * n_size + n_tile * self.tile_n
                if cutlass.const_expr(self.grouping == "kgrouped"):  # A and B shared by groups
                    a_row = m_tile * self.tile_m
                    b_row = n_tile * self.tile_n
                # tiles start at any row of A: offset the TMA coordinate tensors
                gA = cute.local_tile(
                    cute.domain_offset((a_row, 0), mA), (self.tile_m, self.tile_k), (0, None)
                )
                gB = cute.local_tile(
                    cute.domain_offset((b_row, 0), mB), (self.tile_n, self.tile_k), (0, None)
                )
                gSA = cute.local_tile(
                    cute.domain_offset((a_row - a_row % 4, 0), mSA), (self.sa_box_m, 1), (0, None)
                )
                tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                    tma_atom_a, cluster_coord_mnk[1], a_cta_layout, cute.group_modes(sA, 0, 2),
                    cute.group_modes(gA, 0, 2),
                )
                tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
                    tma_atom_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2),
                    cute.group_modes(gB, 0, 2),
                )
                tSAsSA, tSAgSA = cute.nvgpu.cpasync.tma_partition(
                    tma_atom_sa, 0, cute.make_layout(1), cute.group_modes(sSA, 0, 2),
                    cute.group_modes(gSA, 0, 2),
                )
                nb0 = n_tile * self.tile_n // SCALE_BLOCK
                sb_rows = [
                    e * nb_per_group + cutlass.min(nb0 + i, nb_per_group - 1)
                    for i in range(self.num_sb_boxes)
                ]
                for kk in range(k_cnt):
                    k = k_first + kk
                    mainloop_pipeline.producer_acquire(state)
                    bar = mainloop_pipeline.producer_get_barrier(state)
                    cute.copy(tma_atom_sa, tSAgSA[(None, k)], tSAsSA[(None, state.index)],
                              tma_bar_ptr=bar)
                    for i in cutlass.range_constexpr(self.num_sb_boxes):
                        tSBsSB, tSBgSB = sb_parts[i]
                        if cutlass.const_expr(self.b_scale_per_col):
                            src = tSBgSB[(None, n_tile, k)]
                        else:
                            src = tSBgSB[(None, sb_rows[i], k // _SB_BOX_K)]
                        cute.copy(tma_atom_sb, src, tSBsSB[(None, state.index)], tma_bar_ptr=bar)
                    cute.copy(tma_atom_a, tAgA[(None, k)], tAsA[(None, state.index)],
                              tma_bar_ptr=bar, mcast_mask=a_mcast_mask)
                    cute.copy(tma_atom_b, tBgB[(None, k)], tBsB[(None, state.index)],
                              tma_bar_ptr=bar)
                    mainloop_pipeline.producer_commit(state)
                    state.advance()
                t = t + step
            else:
                base = base + g_tiles_m * walk_n
                e = e + 1
                g_start, g_rows, g_live = self._group_info(mGroup, e, m_size, m_max)
                g_tiles_m = (g_rows + self.tile_m - 1) // self.tile_m
        mainloop_pipeline.producer_tail(state)

    # --- consumers: wgmma per K block + promotion, then epilogue --------------------------
    @cute.jit
    def _consumer(
        self,
        mma_tidx,
        warp_idx,
        tiled_mma: cute.TiledMma,
        sA: cute.Tensor,
        sB: cute.Tensor,
        sD: cute.Tensor,
        gD: cute.Tensor,
        n_size,
        tma_atom_d: cute.CopyAtom,
        sSA: cute.Tensor,
        sSB: list,
        mBias: cute.Tensor,
        mainloop_pipeline: pipeline.PipelineTmaAsync,
        k_tile_cnt,
        tile_sched_params: utils.PersistentTileSchedulerParams,
        mD: cute.Tensor,
        mD_raw: cute.Tensor,
        mGroup: cute.Tensor,
        m_max,
    ):
        m_size = cute.size(mD_raw, mode=[0])
        wg_in_mma = mma_tidx // self.threads_per_wg
        thr_mma_wg = tiled_mma.get_slice(wg_in_mma * self.threads_per_wg)
        tCsA = thr_mma_wg.partition_A(sA)
        tCsB = thr_mma_wg.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        # two MMA objects with the ACCUMULATE field fixed once, outside all staged control flow
        # (mutating one object inside loop/if regions makes values escape their region)
        mma_zero = self._make_tiled_mma()
        mma_zero.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        mma_acc = self._make_tiled_mma()
        mma_acc.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        mmas = (mma_zero, mma_acc)

        # per-thread coordinates of the accumulator values inside the CTA tile
        thr_mma = tiled_mma.get_slice(mma_tidx)
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        acc_shape = tCcC.shape
        acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
        blk = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
        blk2 = cute.make_rmem_tensor(acc_shape, self.acc_dtype) if self.overlap else blk
        # value order of a wgmma accumulator: (2 cols, 2 rows (+8), tile_n/8 col groups)
        n_vals = cute.size(acc)
        n_cgroups = n_vals // 4

        # --- epilogue copy setup (registers -> smem via stmatrix, smem -> gmem via TMA)
        copy_atom_r2s = sm90_utils.get_smem_store_op(
            self.d_layout, elem_ty_d=self.out_dtype, elem_ty_acc=self.acc_dtype
        )
        copy_atom_c = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(self.d_layout.is_m_major_c(), 4), self.out_dtype
        )
        tiled_copy_c_atom = cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma)
        tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, tiled_copy_c_atom)
        thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
        tRS_sD = thr_copy_r2s.partition_D(sD)
        tRS_rAcc = tiled_copy_r2s.retile(acc)
        rD_shape = cute.shape(thr_copy_r2s.partition_S(sD))
        tRS_rD = cute.make_rmem_tensor(rD_shape[:3], self.acc_dtype)
        tRS_rD_out = cute.make_rmem_tensor(rD_shape[:3], self.out_dtype)

        tma_store_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads),
        )

        n_sb = 2 * n_cgroups if self.b_scale_per_col else self.num_sb_boxes
        if cutlass.const_expr(self.sb_from_smem):
            n_sb = 1  # unused: the column scales are read at promotion (_retire)
        sa_buf0 = cute.make_rmem_tensor((2,), self.acc_dtype)
        sa_buf1 = cute.make_rmem_tensor((2,), self.acc_dtype)
        sb_buf0 = cute.make_rmem_tensor((n_sb,), self.acc_dtype)
        sb_buf1 = cute.make_rmem_tensor((n_sb,), self.acc_dtype)
        # tile-relative rows (r = 0, 1: +8) and first column of this thread's accumulator values
        # (value v = c + 2*r + 4*j sits at row_l[r], col_l + 8*j + c)
        scale_pos = ([tCcC[0][0], tCcC[2][0]], tCcC[0][1])

        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        release_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Consumer, self.ab_stage
        )
        mma_args = (mmas, tCrA, tCrB, acc, blk, blk2, mainloop_pipeline, (sSA, sSB, scale_pos),
                    (sa_buf0, sb_buf0, sa_buf1, sb_buf1))
        epi_args = (tiled_copy_r2s, tRS_rAcc, tRS_rD, tRS_rD_out, tRS_sD, sD, tma_atom_d,
                    tma_store_pipeline, warp_idx)

        if cutlass.const_expr(self.grouping is None):
            tile_sched = utils.StaticPersistentTileScheduler.create(
                tile_sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
            )
            work_tile = tile_sched.initial_work_tile_info()
            while work_tile.is_valid_tile:
                tile_coord = work_tile.tile_idx
                n0 = tile_coord[1] * self.tile_n
                k_first, k_cnt = self._k_range(tile_coord, k_tile_cnt)
                acc.fill(0.0)
                read_state, release_state = self._mainloop(
                    mma_args, n0, k_first, k_cnt, read_state, release_state
                )
                if cutlass.const_expr(self.bias_dtype is not None):
                    col0 = n0 + tCcC[0][1]
                    for j in cutlass.range_constexpr(n_cgroups):
                        for c in cutlass.range_constexpr(2):
                            bcol = cutlass.min(col0 + 8 * j + c, n_size - 1)
                            bval = mBias[bcol].to(self.acc_dtype)
                            for r in cutlass.range_constexpr(2):
                                v = c + 2 * r + 4 * j
                                acc[v] = acc[v] + bval
                if cutlass.const_expr(self.split_k > 1):
                    gD_tile = gD[(None, None, tile_coord[0], tile_coord[1], tile_coord[2])]
                else:
                    gD_tile = gD[(None, None, tile_coord[0], tile_coord[1])]
                self._epilogue_tma(epi_args, gD_tile, tile_sched.num_tiles_executed)
                tile_sched.advance_to_next_work()
                work_tile = tile_sched.get_current_work()
        else:
            # grouped: walk the groups' tiles in the order every role of the CTA agrees on
            # (see _group_info); tiles straddling the end of a group store row by row
            walk_n = (n_size + self.tile_n - 1) // self.tile_n // self.cluster_shape_mn[1]
            n_groups = self._num_groups(mGroup)
            t, step, rank_n = self._walk_start()
            e = cutlass.Int32(0)
            base = cutlass.Int32(0)
            g_start, g_rows, g_live = self._group_info(mGroup, e, m_size, m_max)
            g_tiles_m = (g_rows + self.tile_m - 1) // self.tile_m
            done = cutlass.Int32(0)
            while e < n_groups:
                if t < base + g_tiles_m * walk_n:
                    local = t - base
                    m_tile = local % g_tiles_m
                    n0 = ((local // g_tiles_m) * self.cluster_shape_mn[1] + rank_n) * self.tile_n
                    off = self._tile_offset(g_rows, m_tile)
                    row0 = g_start + off
                    live = g_live - off
                    k_first, k_cnt = self._tile_k_range(mGroup, e, k_tile_cnt, live)
                    acc.fill(0.0)
                    if k_cnt > 0:
                        # this tile's A scales sit (A row % 4) rows into the stage's box
                        shift = row0 % 4
                        if cutlass.const_expr(self.grouping == "kgrouped"):
                            shift = 0  # A rows m_tile * tile_m
                        tile_args = mma_args[:7] + (
                            (sSA, sSB, ([r + shift for r in scale_pos[0]], scale_pos[1])),
                            mma_args[8],
                        )
                        read_state, release_state = self._mainloop(
                            tile_args, n0, k_first, k_cnt, read_state, release_state
                        )
                    if cutlass.const_expr(self.grouping != "contiguous"):
                        # rows past the group's live rows (masked layout) are zero; contiguous
                        # tiles store no such rows. (Kgrouped tiles have none either, but the
                        # 64-row kgrouped configs spill without this select: ptxas' choice.)
                        for v in cutlass.range_constexpr(n_vals):
                            acc[v] = cutlass.select_(tCcC[v][0] < live, acc[v], cutlass.Float32(0.0))
                    rows = cutlass.min(g_rows - off, self.tile_m)
                    if rows < self.tile_m and row0 + rows < m_size:
                        self._epilogue_direct(acc, tCcC, mD_raw, row0, n0, rows, n_size)
                    else:
                        gD_tile = cute.local_tile(
                            cute.domain_offset((row0, 0), mD), (self.tile_m, self.tile_n),
                            (0, n0 // self.tile_n),
                        )
                        self._epilogue_tma(epi_args, gD_tile, done)
                        done = done + 1
                    t = t + step
                else:
                    base = base + g_tiles_m * walk_n
                    e = e + 1
                    g_start, g_rows, g_live = self._group_info(mGroup, e, m_size, m_max)
                    g_tiles_m = (g_rows + self.tile_m - 1) // self.tile_m

        tma_store_pipeline.producer_tail()

    # --- grouped GEMM: groups, mainloop and epilogues shared by both schedulers ------------
    @cute.jit
    def _num_groups(self, mGroup):
        """Contiguous: E experts + the zero tail after the last group; masked: E."""
        e = cute.size(mGroup, mode=[0])
        if cutlass.const_expr(self.grouping == "contiguous"):
            e = e + 1
        return e

    @cute.jit
    def _walk_start(self):
        """(first walk index, step, N rank in the cluster) of this CTA. The walk enumerates
        (M tile, cluster-wide N tile) pairs of every group, N outer and M inner; a cluster of
        1 x c CTAs takes one index and its CTAs the c neighbouring N tiles, so they load the
        same A tile (multicast). The host requires the N tile count to be a multiple of c."""
        bidx = cute.arch.block_idx()
        return bidx[2], cute.arch.grid_dim()[2], bidx[1]

    @cute.jit
    def _tile_offset(self, g_rows, m_tile):
        """First row of M tile ``m_tile`` inside its group. A partial last tile of a group of at
        least one tile is moved back to end at the group's end: its first rows repeat the
        previous tile's (the same bits: each element's K order is the same), and the whole tile
        is stored by TMA without touching the next group's rows. Only groups shorter than a
        tile are stored row by row (``_epilogue_direct``)."""
        off = m_tile * self.tile_m
        if cutlass.const_expr(self.grouping != "kgrouped"):  # kgrouped tiles are all full
            if off + self.tile_m > g_rows and g_rows >= self.tile_m:
                off = g_rows - self.tile_m
        return off

    @cute.jit
    def _group_info(self, mGroup, e, m_size, m_max):
        """(first row, rows, live rows) of group ``e``: rows are written, live rows computed
        (the others zero). Contiguous: rows ends[e-1]:ends[e], all live; group E is the tail
        ends[E-1]:M with none live. Masked: rows e*M_max:(e+1)*M_max, counts[e] live."""
        num_e = cute.size(mGroup, mode=[0])
        ec = cutlass.min(e, num_e - 1)
        if cutlass.const_expr(self.grouping == "kgrouped"):
            # D rows e*N_out:(e+1)*N_out (N_out passed as m_max), every tile full
            return e * m_max, m_max, m_max
        if cutlass.const_expr(self.grouping == "contiguous"):
            start = cutlass.Int32(0)
            if e > 0:
                start = mGroup[cutlass.max(e - 1, 0)]
            end = m_size
            live_end = m_size
            if e < num_e:
                end = mGroup[ec]
            else:
                live_end = start
            return start, end - start, live_end - start
        return e * m_max, m_max, mGroup[ec]

    @cute.jit
    def _tile_k_range(self, mGroup, e, k_tile_cnt, live):
        """(first K block, K blocks) of a tile of group ``e``: kgrouped, the group's K blocks
        ends[e-1]/128 .. ends[e]/128 (ends are multiples of 128); otherwise all K blocks, none
        for a tile without live rows."""
        k_first = cutlass.Int32(0)
        k_cnt = k_tile_cnt
        if cutlass.const_expr(self.grouping == "kgrouped"):
            start = cutlass.Int32(0)
            if e > 0:
                start = mGroup[e - 1]
            k_first = start // SCALE_BLOCK
            k_cnt = (mGroup[e] - start + SCALE_BLOCK - 1) // SCALE_BLOCK
        else:
            if live <= 0:
                k_cnt = 0
        return k_first, k_cnt

    @cute.jit
    def _mainloop(self, mma_args, n0, k_first, k_cnt, read_state, release_state):
        """``acc`` (zeroed by the caller) += the promoted block products of K blocks k_first ..
        k_first+k_cnt-1 (k_cnt >= 1); returns the advanced pipeline states (the caller reassigns
        them so that its dynamic loop carries them)."""
        # first column (tile-relative) that belongs to the next 128-wide scale block
        split = (n0 // SCALE_BLOCK + 1) * SCALE_BLOCK - n0
        if cutlass.const_expr(self.n_straddle and not self.b_scale_per_col and not self.overlap):
            # one copy of the loop per value split can take (tiles start at multiples of
            # tile_n): each column group's scale block is then known when tracing, instead
            # of two selects per group and K block (19% of the stall samples of 128x160).
            # Not for the overlapped loop (tiles up to 128 wide): unmeasured there, and its
            # 2x-unrolled body in 8 copies takes 5x as long to compile (64x112: 1.7 -> 9 s)
            step = math.gcd(self.tile_n, SCALE_BLOCK)
            for split_c in cutlass.range_constexpr(step, SCALE_BLOCK + 1, step):
                if split == split_c:
                    read_state, release_state = self._mainloop_at(
                        mma_args, split_c, k_first, k_cnt, read_state, release_state
                    )
        else:
            read_state, release_state = self._mainloop_at(
                mma_args, split, k_first, k_cnt, read_state, release_state
            )
        return read_state, release_state

    @cute.jit
    def _mainloop_at(self, mma_args, split, k_first, k_cnt, read_state, release_state):
        """:meth:`_mainloop` for tiles whose next scale block starts at column ``split``."""
        mmas, tCrA, tCrB, acc, blk, blk2, mainloop_pipeline, scales, bufs = mma_args
        sa_buf0, sb_buf0, sa_buf1, sb_buf1 = bufs
        if cutlass.const_expr(self.overlap):
            # software pipeline over K blocks with two block accumulators (blk, blk2):
            # the wgmma of block k+1 is in flight while block k is promoted. Block k's
            # scales are read from its stage right after its wgmma is issued (buf0: even
            # blocks, buf1: odd blocks), before the stage is released.
            # NB: pipeline-state updates stay in this loop body (``x.advance()``) so that
            # the DSL carries the states through the dynamic loop / if regions.
            # prologue: block 0 -> blk (in flight)
            fence_operand(blk)
            self._issue_kblock(
                mmas, tCrA, tCrB, blk, mainloop_pipeline, read_state,
                scales, k_first, sa_buf0, sb_buf0,
            )
            read_state.advance()
            # steady state, straight-line body (keeps ptxas' wgmma register analysis exact):
            # entry and exit: one block in flight in blk (even block 2j)
            for j in range((k_cnt - 1) // 2):
                fence_operand(blk2)
                self._issue_kblock(
                    mmas, tCrA, tCrB, blk2, mainloop_pipeline, read_state,
                    scales, k_first + 2 * j + 1, sa_buf1, sb_buf1,
                )
                read_state.advance()
                cute.nvgpu.warpgroup.wait_group(1)
                fence_operand(blk)
                release_state = self._retire(
                    acc, blk, sa_buf0, sb_buf0, split, scales, mainloop_pipeline, release_state
                )
                fence_operand(acc)
                fence_operand(blk)
                self._issue_kblock(
                    mmas, tCrA, tCrB, blk, mainloop_pipeline, read_state,
                    scales, k_first + 2 * j + 2, sa_buf0, sb_buf0,
                )
                read_state.advance()
                cute.nvgpu.warpgroup.wait_group(1)
                fence_operand(blk2)
                release_state = self._retire(
                    acc, blk2, sa_buf1, sb_buf1, split, scales, mainloop_pipeline, release_state
                )
                fence_operand(acc)
            # tail: the block in blk, plus one more block when k_cnt is even
            if k_cnt % 2 == 0:
                fence_operand(blk2)
                self._issue_kblock(
                    mmas, tCrA, tCrB, blk2, mainloop_pipeline, read_state,
                    scales, k_first + k_cnt - 1, sa_buf1, sb_buf1,
                )
                read_state.advance()
                cute.nvgpu.warpgroup.wait_group(1)
                fence_operand(blk)
                release_state = self._retire(
                    acc, blk, sa_buf0, sb_buf0, split, scales, mainloop_pipeline, release_state
                )
                cute.nvgpu.warpgroup.wait_group(0)
                fence_operand(blk2)
                release_state = self._retire(
                    acc, blk2, sa_buf1, sb_buf1, split, scales, mainloop_pipeline, release_state
                )
            else:
                cute.nvgpu.warpgroup.wait_group(0)
                fence_operand(blk)
                release_state = self._retire(
                    acc, blk, sa_buf0, sb_buf0, split, scales, mainloop_pipeline, release_state
                )
        else:
            for k_tile in range(k_cnt):
                # NB: pipeline-state updates stay in this loop body (``x.advance()``)
                # so that the DSL carries the states through the dynamic loop / if regions.
                self._issue_kblock(
                    mmas, tCrA, tCrB, blk, mainloop_pipeline, read_state,
                    scales, k_first + k_tile, sa_buf0, sb_buf0,
                )
                cute.nvgpu.warpgroup.wait_group(0)
                mainloop_pipeline.consumer_release(read_state)
                read_state.advance()
                release_state.advance()
                self._promote(acc, blk, sa_buf0, sb_buf0, split)
        return read_state, release_state

    @cute.jit
    def _epilogue_tma(self, epi_args, gD_tile, tiles_done):
        """acc -> out dtype -> smem (stmatrix) -> gD_tile (TMA store), epi_tile by epi_tile."""
        (tiled_copy_r2s, tRS_rAcc, tRS_rD, tRS_rD_out, tRS_sD, sD, tma_atom_d,
         tma_store_pipeline, warp_idx) = epi_args
        size_tRS_rD = cute.size(tRS_rD)
        tDgD_for_tma = cute.zipped_divide(gD_tile, self.epi_tile)
        bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
            tma_atom_d,
            0,
            cute.make_layout(1),
            cute.group_modes(sD, 0, 2),
            tDgD_for_tma,
        )
        epi_tile_num = cute.size(tDgD_for_tma, mode=[1])
        epi_tile_shape = tDgD_for_tma.shape[1]
        epi_tile_layout = cute.make_layout(epi_tile_shape, stride=(epi_tile_shape[1], 1))
        if cutlass.const_expr(epi_tile_num <= self.epi_stage):
            # the whole tile fits the staging buffers: one barrier pair per tile instead of one
            # per epi tile. The previous tile's stores were issued a mainloop ago; their smem
            # reads are done by now (the wait is for safety, not for time).
            if warp_idx == self.epi_store_warp_id:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            self.epilog_sync_barrier.arrive_and_wait()
            for epi_idx in cutlass.range_constexpr(epi_tile_num):
                for epi_v in cutlass.range_constexpr(size_tRS_rD):
                    tRS_rD[epi_v] = tRS_rAcc[epi_idx * size_tRS_rD + epi_v]
                tRS_rD_out.store(tRS_rD.load().to(self.out_dtype))
                cute.copy(tiled_copy_r2s, tRS_rD_out, tRS_sD[(None, None, None, epi_idx)])
            cute.arch.fence_proxy("async.shared", space="cta")
            self.epilog_sync_barrier.arrive_and_wait()
            if warp_idx == self.epi_store_warp_id:
                for epi_idx in cutlass.range_constexpr(epi_tile_num):
                    gmem_coord = epi_tile_layout.get_hier_coord(epi_idx)
                    cute.copy(tma_atom_d, bSG_sD[(None, epi_idx)], bSG_gD[(None, gmem_coord)])
                tma_store_pipeline.producer_commit()
        else:
            num_prev_epi_tiles = tiles_done * epi_tile_num
            for epi_idx in cutlass.range_constexpr(epi_tile_num):
                for epi_v in cutlass.range_constexpr(size_tRS_rD):
                    tRS_rD[epi_v] = tRS_rAcc[epi_idx * size_tRS_rD + epi_v]
                tRS_rD_out.store(tRS_rD.load().to(self.out_dtype))
                epi_buffer = (num_prev_epi_tiles + epi_idx) % self.epi_stage
                cute.copy(tiled_copy_r2s, tRS_rD_out, tRS_sD[(None, None, None, epi_buffer)])
                cute.arch.fence_proxy("async.shared", space="cta")
                self.epilog_sync_barrier.arrive_and_wait()
                gmem_coord = epi_tile_layout.get_hier_coord(epi_idx)
                if warp_idx == self.epi_store_warp_id:
                    cute.copy(tma_atom_d, bSG_sD[(None, epi_buffer)], bSG_gD[(None, gmem_coord)])
                    tma_store_pipeline.producer_commit()
                    tma_store_pipeline.producer_acquire()
                self.epilog_sync_barrier.arrive_and_wait()

    @cute.jit
    def _epilogue_direct(self, acc, tCcC, mD, row0, n0, rows, n_size):
        """Store the tile's first ``rows`` rows straight from registers (tiles that end inside
        the output, where a TMA box would overwrite the next group's rows)."""
        for v in cutlass.range_constexpr(cute.size(acc)):
            r = tCcC[v][0]
            col = n0 + tCcC[v][1]
            if r < rows and col < n_size:
                mD[(row0 + r, col)] = acc[v].to(self.out_dtype)

    @cute.jit
    def _k_range(self, tile_coord, k_tile_cnt):
        """(first K block, number of K blocks) of a work tile; split s of S gets a contiguous
        slice of ceil(k_tiles / S) blocks (the host makes sure no split is empty)."""
        k_first = 0
        k_cnt = k_tile_cnt
        if cutlass.const_expr(self.split_k > 1):
            per = (k_tile_cnt + self.split_k - 1) // self.split_k
            k_first = tile_coord[2] * per
            k_cnt = cutlass.min(per, k_tile_cnt - k_first)
        return k_first, k_cnt

    # --- one K block: wgmma into a fresh accumulator, its scales, promotion ---------------
    @cute.jit
    def _issue_kblock(
        self, mmas, tCrA, tCrB, blk, mainloop_pipeline, read_state, scales, k, sa_dst, sb_dst
    ):
        """Wait for the stage of ``read_state``, issue its K block's wgmma batch into the fresh
        accumulator ``blk`` (asynchronous: the caller waits with ``wait_group``) and copy the
        block's scales (K block ``k``) from the stage to registers ``sa_dst``/``sb_dst``.
        ``mmas`` = (MMA with ACCUMULATE off, MMA with ACCUMULATE on)."""
        mainloop_pipeline.consumer_wait(read_state)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            kcoord = (None, None, kb, read_state.index)
            mma = mmas[0] if kb == 0 else mmas[1]
            cute.gemm(mma, blk, tCrA[kcoord], tCrB[kcoord], blk)
        cute.nvgpu.warpgroup.commit_group()
        sSA, sSB, (rows_l, col_l) = scales
        stage = read_state.index
        if cutlass.const_expr(not self.sb_from_smem):  # else both read at promotion (_retire)
            for r in cutlass.range_constexpr(2):
                sa_dst[r] = sSA[(rows_l[r], 0, stage)]
            if cutlass.const_expr(self.b_scale_per_col):
                for j in cutlass.range_constexpr(cute.size(sb_dst) // 2):
                    for c in cutlass.range_constexpr(2):
                        sb_dst[2 * j + c] = sSB[0][(col_l + 8 * j + c, 0, stage)]
            else:
                for i in cutlass.range_constexpr(self.num_sb_boxes):
                    sb_dst[i] = sSB[i][(0, k % _SB_BOX_K, stage)]

    @cute.jit
    def _retire(self, acc, blk, sa, sb, split, scales, mainloop_pipeline, release_state):
        """Promote a finished block and release its stage: after the promotion when its scales
        are read from the stage (``sb_from_smem``: ``sa``/``sb`` unused), else first. Returns
        the advanced release state."""
        if cutlass.const_expr(self.sb_from_smem):
            sSA, sSB, (rows_l, col_l) = scales
            stage = release_state.index
            self._promote_per_col(
                acc, blk, [sSA[(rows_l[r], 0, stage)] for r in range(2)],
                lambda j, c: sSB[0][(col_l + 8 * j + c, 0, stage)],
            )
            mainloop_pipeline.consumer_release(release_state)
            release_state.advance()
        else:
            mainloop_pipeline.consumer_release(release_state)
            release_state.advance()
            self._promote(acc, blk, sa, sb, split)
        return release_state

    @cute.jit
    def _promote_per_col(self, acc, blk, sa, col_scale):
        """1x128 B scales: acc += blk * (sa[row] * col_scale(j, c)) for the thread's column
        8j + c (traced inline: ``col_scale`` reads a register buffer or the stage)."""
        for j in cutlass.range_constexpr(cute.size(acc) // 4):
            for c in cutlass.range_constexpr(2):
                s_col = col_scale(j, c)
                for r in cutlass.range_constexpr(2):
                    v = c + 2 * r + 4 * j
                    acc[v] = acc[v] + blk[v] * (sa[r] * s_col)

    @cute.jit
    def _promote(self, acc, blk, sa, sb, split):
        """acc += blk * sa[row] * sb[col]; value v = c + 2*r + 4*j sits at row +8r, col 8j+c."""
        n_cgroups = cute.size(acc) // 4
        if cutlass.const_expr(self.b_scale_per_col):
            self._promote_per_col(acc, blk, sa, lambda j, c: sb[2 * j + c])
        else:
            # one product per (row, scale block touched); block i >= 1 starts at column
            # split + 128 * (i - 1) of the tile
            p = [[sa[r] * sb[i] for r in range(2)] for i in range(self.num_sb_boxes)]
            for j in cutlass.range_constexpr(n_cgroups):
                for r in cutlass.range_constexpr(2):
                    if cutlass.const_expr(self.n_straddle):
                        # split is a multiple of 16: a group of 8 columns never straddles
                        s = p[0][r]
                        for i in cutlass.range_constexpr(1, self.num_sb_boxes):
                            if cutlass.const_expr(isinstance(split, int)):
                                if cutlass.const_expr(8 * j >= split + SCALE_BLOCK * (i - 1)):
                                    s = p[i][r]
                            else:
                                s = cutlass.select_(8 * j < split + SCALE_BLOCK * (i - 1), s, p[i][r])
                    else:
                        s = p[8 * j // SCALE_BLOCK][r]
                    for c in cutlass.range_constexpr(2):
                        v = c + 2 * r + 4 * j
                        acc[v] = acc[v] + blk[v] * s
