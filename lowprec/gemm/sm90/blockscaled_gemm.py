"""Hopper (sm_90a) FP8 block-scaled GEMM in CuTe DSL.

    D[m, n] = sum_kb (A[m, kb-block] . B[n, kb-block]) * sa[m, kb] * sb[n-scale, kb]  (+ bias[n])

A: E4M3 [M, K] K-major with 1x128 scales ``sa`` [M, ceil(K/128)] (fp32, MN-major: stride (1, ld),
ld a multiple of 4). B: E4M3 [N, K] K-major with either 128x128 scales ``sb``
[ceil(N/128), ceil(K/128)] ("block" kind) or 1x128 scales [N, ceil(K/128)] ("col" kind).

Structure (DeepGEMM-style promotion, warp specialised, persistent), composed of the building
blocks of ``lowprec.cute``:

* warpgroup 0 (producer, ``setmaxnreg`` 40; 24 with 1x128 B scales and a bias): one warp fills
  the ``TmaRing``: per stage one 128-wide K block, the A and B tiles (optionally multicast
  across a cluster) and their scales (the tile's A row scales; its B column scales or 128x128
  block scales), as a list of ``TmaLoad`` issued by ``TmaRing.fill``.
* warpgroups 1..2 (consumers, ``setmaxnreg`` 232; 240 with 1x128 B scales and a bias): each owns
  64 rows of each wave of the CTA tile (a wave: 64 rows per consumer warpgroup; 256-row tiles
  have two, slices of the stage's one A box) and runs the ``PromotedMainloop``
  (``mainloop.py``): per K block a ``BlockMma`` batch into a fresh accumulator, the block's
  scales (``FragmentScales``), FP32 promotion (``promote``).
* epilogue: optional bias, conversion, ``stmatrix`` to shared memory, TMA store
  (``TmaStoreEpilogue``: 16-bit outputs staged whole, one barrier pair per tile; fp32 through two
  buffers, a pair per slice); dense tiles staged whole are stored by warp 1 of warpgroup 0
  (``TmaStoreWarp``): the consumers write, arrive and go on; grouped tiles that end inside the
  output store row by row from registers (``store_direct``).
* schedules (``grouping``): None — the wheel's static persistent scheduler over (M tiles,
  N tiles, K splits) (``DenseTileScheduler``), grid = #SMs / cluster size, 2-CTA clusters
  multicast the shared operand, split-K writes fp32 partials; "contiguous" / "masked" /
  "kgrouped" — the MoE grouped GEMMs, tiles from a walk over the groups that reads their sizes
  on the device (``GroupedTileScheduler``). Producer and consumers drive either scheduler with
  the same loop (``_producer``, ``_consumer``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.memory import SmemAllocator
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from ...cute.sm90.epilogue import TmaStoreEpilogue, TmaStoreWarp, add_col_vector, store_direct
from ...cute.sm90.mma import BlockMma
from ...cute.sm90.scales import (
    FragmentScales,
    ScaleRegs,
    row_box_offset,
    row_box_start,
    staged_scale_floats,
    staged_scale_layout,
)
from ...cute.sm90.tma_ring import TmaLoad, TmaRing, tma_partition_tiles
from ...cute.tile_scheduler import DenseTileScheduler, GroupedTileScheduler
from ...cute.utils import fence_operand, round_up  # noqa: F401  (fence_operand re-exported)
from .config import SCALE_BLOCK, TileConfig, group_box_rows, scale_blocks_spanned, valid_tile_n  # noqa: F401
from .mainloop import KSlot, PromotedMainloop, Wave

SMEM_CAPACITY_SM90 = 232448  # bytes of dynamic smem per CTA on sm_90
_SB_BOX_K = 4  # K blocks per TMA box of 128x128 B scales (16 bytes: the smallest TMA box row)


class BlockScaledGemmSm90:
    """Persistent warp-specialised FP8 block-scaled GEMM for sm_90a.

    :param config: tile configuration
    :param out_dtype: cutlass.BFloat16 / cutlass.Float16 / cutlass.Float32
    :param b_block_n: rows of B per scale block (each 128 wide along K): 128 (128x128 weight
        scales), 1 (one scale per row of B: 1x128, weight gradients) or a multiple of 8 dividing
        tile_n (16: 16x128 blocks, dense GEMMs)
    :param bias_dtype: None (no bias) or cutlass.Float32 / cutlass.BFloat16
    :param num_sms: number of SMs of the target GPU (persistent grid size), a compile constant
    :param grouping: None (one GEMM); "contiguous" / "masked": one GEMM per group of A's rows
        against B[e] (128x128 B scales); "kgrouped": one GEMM per group of K blocks,
        D[e] = A[:, Ke] B[:, Ke]^T (weight gradients, 1x128 B scales). Grouped: no bias or
        split-K; clusters only along N (the two CTAs take neighbouring N tiles of one M tile).
    """

    def __init__(
        self,
        config: TileConfig,
        out_dtype: type[cutlass.Numeric],
        b_block_n: int,
        bias_dtype: type[cutlass.Numeric] | None,
        num_sms: int,
        grouping: str | None = None,
    ):
        self._check_options(config, b_block_n, bias_dtype, grouping)
        self.config = config
        self.out_dtype = out_dtype
        # below 128 rows the B scales run along N per K block, N-contiguous (one or a group per column)
        self.b_scale_per_col = b_block_n < SCALE_BLOCK
        self.b_col_group = b_block_n if self.b_scale_per_col else 1
        self.bias_dtype = bias_dtype
        self.num_sms = num_sms
        self.grouping = grouping
        self.split_k = config.split_k
        # a second block accumulator (tile_n/2 registers) must fit next to acc and blk
        self.overlap = config.mma_overlap and config.tile_n <= 128 and config.tile_m <= 128
        # 1x128 B scales with two block accumulators: the tile_n/4 column scales are read from the
        # stage at promotion time (the stage is released after it) instead of being held in
        # registers, which leaves no room for blk2 above 64 columns. 16x128 B blocks hold tile_n / 16
        # scales per slot: they fit on 128-row tiles, not on 64-row ones (64x128: 11-13 LDL/STL in
        # registers, none from the stage; session 45)
        self.sb_from_smem = (self.b_scale_per_col and self.overlap and config.tile_n > 64
                             and (self.b_col_group == 1 or config.tile_m == 64))

        self.acc_dtype = cutlass.Float32
        self.ab_dtype = cutlass.Float8E4M3FN
        self.tile_m, self.tile_n, self.tile_k = config.tile_m, config.tile_n, SCALE_BLOCK
        # grouped tiles start at any row, but a TMA box of A scales must start 16-byte aligned:
        # load from the row rounded down to a multiple of 4, with 4 extra rows
        self.sa_box_m = self.tile_m + (4 if grouping is not None else 0)
        self.cluster_shape_mn = (config.cluster_m, config.cluster_n)
        self.num_mma_wg = min(self.tile_m // 64, 2)
        self.wave_m = 64 * self.num_mma_wg
        self.waves = self.tile_m // self.wave_m
        self.atom_layout_mnk = (self.num_mma_wg, 1, 1)
        self.threads_per_wg = 128
        self.threads_per_cta = (1 + self.num_mma_wg) * self.threads_per_wg
        self.num_mma_threads = self.num_mma_wg * self.threads_per_wg
        self.load_warp_id = 0
        self.epi_store_warp_id = 4  # first warp of the first consumer warpgroup
        # 1x128 B scales with a bias: the consumers need 8 more registers (232 left 23 LDL/STL
        # in 128x128 c2x1); 128 * 24 + 256 * 240 still fits the 64K register file
        # (NOTES, session 11)
        wide = self.b_scale_per_col and (bias_dtype is not None or config.tile_m == 256)
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
        # the handshake of a store warp apart (TmaStoreWarp) with the consumer threads
        self.epi_free_barrier = pipeline.NamedBarrier(barrier_id=2, num_threads=self.num_mma_threads + 32)
        self.epi_full_barrier = pipeline.NamedBarrier(barrier_id=3, num_threads=self.num_mma_threads + 32)

    @staticmethod
    def _check_options(config, b_block_n, bias_dtype, grouping):
        if b_block_n not in (1, SCALE_BLOCK) and not (grouping is None and b_block_n % 8 == 0
                                                      and config.tile_n % b_block_n == 0):
            raise ValueError(f"b_block_n {b_block_n}: expected 128, 1, or (dense GEMMs) a multiple of 8 "
                             f"dividing tile_n ({config.tile_n})")
        if config.tile_m not in (64, 128, 256):
            raise ValueError(f"tile_m must be 64, 128 or 256, got {config.tile_m}")
        if config.tile_m == 256 and (grouping is not None or config.split_k > 1 or config.tile_n > 128):
            raise ValueError("tile_m=256: dense GEMMs, no split-K, tile_n <= 128")
        if not valid_tile_n(config.tile_n):
            raise ValueError(f"unsupported tile_n {config.tile_n}")
        if grouping not in (None, "contiguous", "masked", "kgrouped"):
            raise ValueError(
                f"grouping must be None, 'contiguous', 'masked' or 'kgrouped', got {grouping!r}"
            )
        if grouping is not None and (
            (b_block_n == 1) != (grouping == "kgrouped") or bias_dtype is not None
            or config.split_k > 1 or config.cluster_m != 1 or config.cluster_n not in (1, 2)
        ):
            raise ValueError(
                "grouped GEMM: no bias, split_k 1, cluster 1x1 or 1x2; 1x128 B scales exactly for "
                "kgrouped"
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
        self.epi_tile = (self.wave_m, epi_n)
        # 16-bit out: 4 buffers hold a tile up to 128 wide, wider tiles get one per slice: one
        # barrier pair per tile (TmaStoreEpilogue; 2 buffers and a 6th A/B stage measured 3-15%
        # slower, NOTES v7; 128x160 +14% with 5, session 13). 80/112-wide tiles (16-column
        # slices) keep 4: more buffers there are unmeasured.
        if self.out_dtype.width != 16:
            self.epi_stage = 2
        elif self.tile_n > 128:
            self.epi_stage = self.tile_n // epi_n
        else:
            self.epi_stage = 4 * self.waves
        self.d_layout = LayoutEnum.ROW_MAJOR
        # dense tiles staged whole: warp 1 (producer warpgroup, idle otherwise) issues the TMA
        # stores, so a consumer warpgroup starts its next tile without waiting for the other one
        # or for the stores (with the first consumer warp storing, its warpgroup's first wgmma
        # of the next tile waited for it: ncu, NOTES session 34)
        self.epi_slices = self.tile_n // epi_n
        self.store_warp_apart = self.grouping is None and self.epi_slices * self.waves <= self.epi_stage
        if self.store_warp_apart:
            self.epi_store_warp_id = 1

        # scales ride in the same pipeline stage as their K block (TMA, 128-byte aligned slots):
        # A: tile_m row scales; B: tile_n column scales (1x128), the tile_n / g column-group
        # scales padded to a 16-byte box (16x128; the host lays each tile's box out apart:
        # interface._prep_b_scale_groups), or one 4-wide box of the [NB, KB] grid per 128-column
        # block the tile touches (128x128)
        if not self.b_scale_per_col:
            self.sb_box = (1, _SB_BOX_K)
        elif self.b_col_group > 1:
            self.sb_box = (group_box_rows(self.tile_n, self.b_col_group), 1)
        else:
            self.sb_box = (self.tile_n, 1)
        self.num_sb_boxes = 1 if self.b_scale_per_col else scale_blocks_spanned(self.tile_n)
        scale_bytes_per_stage = 4 * (
            round_up(self.sa_box_m, 32) + self.num_sb_boxes * round_up(self.sb_box[0] * self.sb_box[1], 32)
        )
        ab_bytes_per_stage = (
            (self.tile_m + self.tile_n) * self.tile_k * self.ab_dtype.width // 8 + scale_bytes_per_stage
        )
        epi_bytes = self.wave_m * epi_n * self.out_dtype.width // 8 * self.epi_stage
        self.ab_stage = min(
            12, (SMEM_CAPACITY_SM90 - 2048 - epi_bytes) // ab_bytes_per_stage
        )
        # one buffer and one TMA box of all tile_m rows per stage; each wave reads its 64 x
        # num_mma_wg rows as a slice (the swizzle atom's 8 rows divide a wave)
        self.a_smem_layout_staged = self._ab_smem_layout(self.tile_m)
        self.b_smem_layout_staged = self._ab_smem_layout(self.tile_n)
        self.epi_smem_layout_staged = sm90_utils.make_smem_layout_epi(
            self.out_dtype, self.d_layout, self.epi_tile, self.epi_stage
        )
        self.sa_smem_layout_staged, self.sb_smem_layout_staged = self._scale_smem_layouts()

    def _ab_smem_layout(self, rows: int):
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.ab_dtype, self.tile_k),
            self.ab_dtype,
        )
        return cute.tile_to_shape(atom, (rows, self.tile_k, self.ab_stage), order=(0, 1, 2))

    def _scale_smem_layouts(self):
        """(A-scale, B-scale) staged smem layouts; built again inside the kernel (layouts made
        on the host side may not be captured by the kernel region)."""
        return (staged_scale_layout((self.sa_box_m, 1), self.ab_stage),
                staged_scale_layout(self.sb_box, self.ab_stage))

    def _sb_box_floats(self) -> int:
        """smem floats of one staged B-scale box buffer (a multiple of 32: 128-byte aligned)"""
        return staged_scale_floats(self.sb_box, self.ab_stage)

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
        tma = self._make_tma_atoms(mA, mB, mSA, mSB, mD)  # (atom, coordinate tensor) of A, B, D, SA, SB
        sched_params, grid = self._schedule(mD)
        self.shared_storage = self._shared_storage()
        self.kernel(
            *tma[0], *tma[1], *tma[2], *tma[3], *tma[4], mBias, mD, mGroup, m_max, self.tiled_mma, self.cta_layout_mnk,
            self.a_smem_layout_staged, self.b_smem_layout_staged, self.epi_smem_layout_staged, sched_params,
        ).launch(
            grid=grid,
            block=[self.threads_per_cta, 1, 1],
            cluster=(*self.cluster_shape_mn, 1),
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=self.config.pdl,
        )

    def _make_tma_atoms(self, mA, mB, mSA, mSB, mD):
        """TMA atoms and coordinate tensors of (A, B, D, A scales, B scales): A multicast along
        cluster N, B along cluster M; scales per CTA (no multicast)."""
        g2s, g2s_mcast = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp, cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp
        a = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s_mcast() if self.is_a_mcast else g2s(), mA, cute.slice_(self.a_smem_layout_staged, (None, None, 0)),
            (self.tile_m, self.tile_k), num_multicast=self.num_mcast_ctas_a,
        )
        b = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s_mcast() if self.is_b_mcast else g2s(), mB, cute.slice_(self.b_smem_layout_staged, (None, None, 0)),
            (self.tile_n, self.tile_k), num_multicast=self.num_mcast_ctas_b,
        )
        sa = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s(), mSA, cute.slice_(self.sa_smem_layout_staged, (None, None, 0)), (self.sa_box_m, 1)
        )
        sb = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s(), mSB, cute.slice_(self.sb_smem_layout_staged, (None, None, 0)), self.sb_box
        )
        d = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mD,
            cute.slice_(self.epi_smem_layout_staged, (None, None, 0)), self.epi_tile,
        )
        return a, b, d, sa, sb

    def _schedule(self, mD):
        """(dense scheduler params, launch grid)."""
        m = cute.size(mD, mode=[0])
        n = cute.size(mD, mode=[1])
        num_tiles_mnl = ((m + self.tile_m - 1) // self.tile_m, (n + self.tile_n - 1) // self.tile_n, self.split_k)
        params = DenseTileScheduler.params(num_tiles_mnl, self.cluster_shape_mn, self.config.swizzle,
                                           self.config.raster_along_m)
        max_active_clusters = self.num_sms // (self.cluster_shape_mn[0] * self.cluster_shape_mn[1])
        grid = DenseTileScheduler.grid(params, max_active_clusters)
        if cutlass.const_expr(self.grouping is not None):
            grid = GroupedTileScheduler.grid(self.cluster_shape_mn[1], self.num_sms)
        return params, grid

    def _shared_storage(self):
        """The kernel's shared memory: ring barriers, A/B stages, epilogue buffers, scale boxes."""
        def aligned(dtype, n, align):
            return cute.struct.Align[cute.struct.MemRange[dtype, n], align]

        fields = {
            "mainloop_pipeline_array_ptr": cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2],
            "sA": aligned(self.ab_dtype, cute.cosize(self.a_smem_layout_staged), self.buffer_align_bytes),
            "sB": aligned(self.ab_dtype, cute.cosize(self.b_smem_layout_staged), self.buffer_align_bytes),
            "sD": aligned(self.out_dtype, cute.cosize(self.epi_smem_layout_staged), self.buffer_align_bytes),
            "sSA": aligned(cutlass.Float32, cute.cosize(self.sa_smem_layout_staged), 128),
            "sSB": aligned(cutlass.Float32, self._sb_box_floats() * self.num_sb_boxes, 128),
        }
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

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
        sched_params: utils.PersistentTileSchedulerParams,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_a, tma_atom_b, tma_atom_d, tma_atom_sa, tma_atom_sb):
                cute.nvgpu.cpasync.prefetch_descriptor(atom)
        cta_rank_in_cluster = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord_mnk = cta_layout_mnk.get_flat_coord(cta_rank_in_cluster)
        storage = SmemAllocator().allocate(self.shared_storage)
        ring = self._make_ring(storage, a_smem_layout_staged, b_smem_layout_staged, cta_layout_mnk)
        pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mn, is_relaxed=True)
        sA = storage.sA.get_tensor(a_smem_layout_staged.outer, swizzle=a_smem_layout_staged.inner)
        sAs = [cute.local_tile(sA, (self.wave_m, self.tile_k, self.ab_stage), (w, 0, 0)) for w in range(self.waves)]
        sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)
        sD = storage.sD.get_tensor(epi_smem_layout_staged.outer, swizzle=epi_smem_layout_staged.inner)
        sa_layout, sb_layout = self._scale_smem_layouts()
        sSA = storage.sSA.get_tensor(sa_layout)
        sSB = [cute.make_tensor(storage.sSB.data_ptr() + i * self._sb_box_floats(), sb_layout)
               for i in range(self.num_sb_boxes)]
        gSB = cute.local_tile(mSB, self.sb_box, (None, None))
        # all K blocks (a split handles a slice of them)
        k_tile_cnt = cute.size(cute.local_tile(mA, (self.tile_m, self.tile_k), (None, None)), mode=[3])
        warp_group_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)

        pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)
        if cutlass.const_expr(self.config.pdl):
            # everything above is private to this CTA; from here on global memory is read and
            # written, so the previous grid must be done. Dependents may launch now: they only
            # fit on an SM once this CTA has left (it holds the register file and smem).
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        sched_args = (mGroup, mD, m_max, k_tile_cnt, sched_params)
        if warp_group_idx == 0:
            cute.arch.setmaxregister_decrease(self.load_regs)
            if warp_idx == self.load_warp_id:
                self._producer((tma_atom_a, tma_atom_b, tma_atom_sa, tma_atom_sb), mA, mB, mSA, gSB, sA, sB, sSA,
                               sSB, ring, cta_layout_mnk, cluster_coord_mnk, sched_args)
            if cutlass.const_expr(self.store_warp_apart):
                if warp_idx == self.epi_store_warp_id:
                    self._store_warp(sD, mD, tma_atom_d, sched_args)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self._consumer(tidx - self.threads_per_wg, warp_idx, tiled_mma, sAs, sB, sD, mD, tma_atom_d, sSA, sSB,
                           mBias, mD_raw, ring, sched_args)

    def _make_ring(self, storage, a_smem_layout_staged, b_smem_layout_staged, cta_layout_mnk):
        """The A/B/scales ring: a stage holds one K block's tiles and scale boxes; released by
        every consumer warp of each CTA the stage's tiles were multicast to."""
        stage_bytes = (
            cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem_layout_staged, (None, None, 0)))
            + cute.size_in_bytes(self.ab_dtype, cute.slice_(b_smem_layout_staged, (None, None, 0)))
            + 4 * (self.sa_box_m + self.sb_box[0] * self.sb_box[1] * self.num_sb_boxes)
        )
        mcast_size = self.num_mcast_ctas_a + self.num_mcast_ctas_b - 1
        return TmaRing.create(storage.mainloop_pipeline_array_ptr.data_ptr(), self.ab_stage, stage_bytes,
                              mcast_size * self.num_mma_wg * 4, cute.make_layout((1, *cta_layout_mnk.shape)))

    def _scheduler(self, sched_args):
        """This CTA's tile walk (the producer and the consumers each make their own)."""
        mGroup, mD, m_max, k_tile_cnt, sched_params = sched_args
        if cutlass.const_expr(self.grouping is None):
            return DenseTileScheduler.create(sched_params, self.tile_n, k_tile_cnt, self.split_k)
        return GroupedTileScheduler.create(
            self.grouping, mGroup, (self.tile_m, self.tile_n, self.tile_k), self.cluster_shape_mn[1],
            cute.size(mD, mode=[0]), cute.size(mD, mode=[1]), m_max, k_tile_cnt,
        )

    # --- producer: TMA loads of A/B K blocks and their scales into the ring ---------------
    @cute.jit
    def _producer(self, atoms, mA, mB, mSA, gSB, sA, sB, sSA, sSB, ring, cta_layout_mnk, cluster_coord_mnk,
                  sched_args):
        tma_atom_a, tma_atom_b, tma_atom_sa, tma_atom_sb = atoms
        a_mcast_mask = 0
        b_mcast_mask = 0
        if cutlass.const_expr(self.is_a_mcast):
            a_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord_mnk, mode=1)
        if cutlass.const_expr(self.is_b_mcast):
            b_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord_mnk, mode=0)
        a_cta = (cluster_coord_mnk[1], cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape))
        b_cta = (cluster_coord_mnk[0], cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape))
        sb_parts = [tma_partition_tiles(tma_atom_sb, s, gSB) for s in sSB]
        dense_parts = None
        if cutlass.const_expr(self.grouping is None):
            dense_parts = (
                tma_partition_tiles(tma_atom_a, sA, cute.local_tile(mA, (self.tile_m, self.tile_k), (None, None)),
                                    *a_cta),
                tma_partition_tiles(tma_atom_b, sB, cute.local_tile(mB, (self.tile_n, self.tile_k), (None, None)),
                                    *b_cta),
                tma_partition_tiles(tma_atom_sa, sSA, cute.local_tile(mSA, (self.tile_m, 1), (None, None))),
            )
        sched = self._scheduler(sched_args)
        state = ring.producer_state()
        while sched.is_valid():
            if sched.has_tile():
                tile = sched.work_tile()
                if cutlass.const_expr(self.grouping is None):
                    loads = self._dense_loads(atoms, dense_parts, sb_parts, tile, a_mcast_mask, b_mcast_mask,
                                              cute.size(gSB, mode=[2]))
                else:
                    loads = self._grouped_loads(atoms, mA, mB, mSA, sA, sB, sSA, sb_parts, tile, a_cta,
                                                a_mcast_mask, sched.n_size)
                for kk in range(tile.k_cnt):
                    ring.fill(state, loads, tile.k_first + kk)
                    state.advance()
                sched.advance()
            else:
                sched.next_group()
        ring.producer_tail(state)

    def _sb_loads(self, tma_atom_sb, sb_parts, rows):
        """The B-scale loads of a tile: box i from row ``rows[i]`` of the box grid (1x128 scales:
        one box of tile_n columns, every K block; 128x128: one box of 4 K blocks per block)."""
        div = 1 if self.b_scale_per_col else _SB_BOX_K
        return [TmaLoad(tma_atom_sb, tSBgSB[(None, rows[i], None)], tSBsSB, step_div=div)
                for i, (tSBsSB, tSBgSB) in enumerate(sb_parts)]

    def _dense_loads(self, atoms, dense_parts, sb_parts, tile, a_mcast_mask, b_mcast_mask, nsb_rows):
        tma_atom_a, tma_atom_b, tma_atom_sa, tma_atom_sb = atoms
        (tAsA, tAgA), (tBsB, tBgB), (tSAsSA, tSAgSA) = dense_parts
        if cutlass.const_expr(self.b_scale_per_col):
            sb_rows = [tile.n_tile]
        else:
            nb0 = tile.n0 // SCALE_BLOCK
            sb_rows = [cutlass.min(nb0 + i, nsb_rows - 1) for i in range(self.num_sb_boxes)]
        return [
            TmaLoad(tma_atom_sa, tSAgSA[(None, tile.m_tile, None)], tSAsSA),
            *self._sb_loads(tma_atom_sb, sb_parts, sb_rows),
            TmaLoad(tma_atom_a, tAgA[(None, tile.m_tile, None)], tAsA, mcast_mask=a_mcast_mask),
            TmaLoad(tma_atom_b, tBgB[(None, tile.n_tile, None)], tBsB, mcast_mask=b_mcast_mask),
        ]

    def _grouped_loads(self, atoms, mA, mB, mSA, sA, sB, sSA, sb_parts, tile, a_cta, a_mcast_mask, n_size):
        """Tiles start at any row of A: the TMA coordinate tensors are offset to the tile."""
        tma_atom_a, tma_atom_b, tma_atom_sa, tma_atom_sb = atoms
        a_row = tile.row0
        b_row = tile.group * n_size + tile.n0
        if cutlass.const_expr(self.grouping == "kgrouped"):  # A and B shared by the groups
            a_row = tile.m_tile * self.tile_m
            b_row = tile.n0
        gA = cute.local_tile(cute.domain_offset((a_row, 0), mA), (self.tile_m, self.tile_k), (0, None))
        gB = cute.local_tile(cute.domain_offset((b_row, 0), mB), (self.tile_n, self.tile_k), (0, None))
        gSA = cute.local_tile(cute.domain_offset((row_box_start(a_row), 0), mSA), (self.sa_box_m, 1), (0, None))
        tAsA, tAgA = tma_partition_tiles(tma_atom_a, sA, gA, *a_cta)
        tBsB, tBgB = tma_partition_tiles(tma_atom_b, sB, gB)
        tSAsSA, tSAgSA = tma_partition_tiles(tma_atom_sa, sSA, gSA)
        if cutlass.const_expr(self.b_scale_per_col):
            sb_rows = [tile.n_tile]
        else:
            nb_per_group = (n_size + SCALE_BLOCK - 1) // SCALE_BLOCK
            nb0 = tile.n0 // SCALE_BLOCK
            sb_rows = [tile.group * nb_per_group + cutlass.min(nb0 + i, nb_per_group - 1)
                       for i in range(self.num_sb_boxes)]
        return [
            TmaLoad(tma_atom_sa, tSAgSA, tSAsSA),
            *self._sb_loads(tma_atom_sb, sb_parts, sb_rows),
            TmaLoad(tma_atom_a, tAgA, tAsA, mcast_mask=a_mcast_mask),
            TmaLoad(tma_atom_b, tBgB, tBsB),
        ]

    # --- consumers: the promoted K loop, then the epilogue -------------------------------
    @cute.jit
    def _consumer(self, mma_tidx, warp_idx, tiled_mma, sAs, sB, sD, mD, tma_atom_d, sSA, sSB, mBias, mD_raw, ring,
                  sched_args):
        wg_in_mma = cute.arch.make_warp_uniform(mma_tidx // self.threads_per_wg)
        mmas = [BlockMma.create(self._make_tiled_mma, tiled_mma, sA, sB, wg_in_mma * self.threads_per_wg)
                for sA in sAs]
        # per-thread coordinates of the accumulator values inside a wave of the CTA tile
        tCcC = tiled_mma.get_slice(mma_tidx).partition_C(cute.make_identity_tensor((self.wave_m, self.tile_n)))
        accs = [cute.make_rmem_tensor(tCcC.shape, self.acc_dtype) for _ in range(self.waves)]
        acc = accs[0]
        blk = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
        blk2 = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype) if self.overlap else blk
        epi = TmaStoreEpilogue.create(
            tiled_mma, accs, sD, tma_atom_d, mma_tidx, warp_idx, self.out_dtype, self.d_layout, self.epi_tile,
            self.epi_stage, self.epi_store_warp_id, self.epilog_sync_barrier, self.num_mma_threads,
        )
        mainloop = self._make_mainloop(ring, mmas, tCcC, accs, blk, blk2, sSA, sSB)
        read_state = ring.consumer_state()
        release_state = ring.consumer_state()
        done = cutlass.Int32(0)  # grouped: tiles stored by TMA (dense: the scheduler counts)
        sched = self._scheduler(sched_args)
        while sched.is_valid():
            if sched.has_tile():
                tile = sched.work_tile()
                n0 = tile.n0
                for a in accs:
                    a.fill(0.0)
                if cutlass.const_expr(self.grouping is None):
                    read_state, release_state = mainloop.run(n0, tile.k_first, tile.k_cnt, read_state, release_state)
                    if cutlass.const_expr(self.bias_dtype is not None):
                        for a in accs:
                            add_col_vector(a, mBias, n0 + tCcC[0][1], cute.size(mD, mode=[1]))
                    if cutlass.const_expr(self.store_warp_apart):
                        epi.write_for_store_warp(self.epi_slices, self.epi_free_barrier, self.epi_full_barrier)
                    else:
                        epi.store(self._dense_gd_tiles(mD, tile), sched.num_tiles_executed)
                else:
                    read_state, release_state = self._grouped_mainloop(mainloop, tile, n0, read_state, release_state)
                    done = self._grouped_epilogue(epi, acc, tile, n0, tCcC, mD, mD_raw, done)
                sched.advance()
            else:
                sched.next_group()
        if cutlass.const_expr(not self.store_warp_apart):
            epi.tail()

    @cute.jit
    def _store_warp(self, sD, mD, tma_atom_d, sched_args):
        """The store warp apart: the consumers' tile walk, storing each tile they write."""
        store = TmaStoreWarp.create(sD, tma_atom_d, self.epi_tile, self.epi_free_barrier, self.epi_full_barrier)
        sched = self._scheduler(sched_args)
        while sched.is_valid():
            store.store(self._dense_gd_tiles(mD, sched.work_tile()))
            sched.advance()
        store.tail()

    def _make_mainloop(self, ring, mmas, tCcC, accs, blk, blk2, sSA, sSB):
        n_cgroups = cute.size(blk) // 4  # accumulator value order: (2 cols, 2 rows (+8), tile_n/8 groups)
        n_sb = 2 * n_cgroups if self.b_scale_per_col else self.num_sb_boxes
        if self.b_col_group > 1:
            n_sb = self.tile_n // self.b_col_group
        if cutlass.const_expr(self.sb_from_smem):
            n_sb = 1  # unused: the column scales are read at promotion
        slots = (KSlot(blk, ScaleRegs(n_sb)), KSlot(blk2, ScaleRegs(n_sb)))
        # tile-relative rows (r = 0, 1: +8) and first column of this thread's accumulator values
        scales = FragmentScales(sSA, sSB, [tCcC[0][0], tCcC[2][0]], tCcC[0][1], self.b_scale_per_col, _SB_BOX_K,
                                self.b_col_group)
        waves = [Wave(mma, scales.shifted(w * self.wave_m), acc) for w, (mma, acc) in enumerate(zip(mmas, accs))]
        return PromotedMainloop(ring, waves, slots if self.overlap else slots[:1],
                                overlap=self.overlap, sb_from_smem=self.sb_from_smem, per_col=self.b_scale_per_col,
                                n_straddle=self.n_straddle, tile_n=self.tile_n, col_group=self.b_col_group)

    def _dense_gd_tiles(self, mD, tile):
        """A dense tile's gmem tiles, one per wave."""
        if cutlass.const_expr(self.split_k > 1):  # mD is (M, N, split_k) fp32 partials (one wave)
            gD = cute.local_tile(mD, (self.tile_m, self.tile_n), (None, None, None))
            return [gD[(None, None, tile.coord[0], tile.coord[1], tile.coord[2])]]
        gD = cute.local_tile(mD, (self.wave_m, self.tile_n), (None, None))
        return [gD[(None, None, tile.coord[0] * self.waves + w, tile.coord[1])] for w in range(self.waves)]

    @cute.jit
    def _grouped_mainloop(self, mainloop, tile, n0, read_state, release_state):
        if tile.k_cnt > 0:
            # this tile's A scales sit (A row % 4) rows into the stage's box (kgrouped: A rows
            # m_tile * tile_m)
            shift = row_box_offset(tile.row0)
            if cutlass.const_expr(self.grouping == "kgrouped"):
                shift = 0
            read_state, release_state = mainloop.shifted(shift).run(
                n0, tile.k_first, tile.k_cnt, read_state, release_state
            )
        return read_state, release_state

    @cute.jit
    def _grouped_epilogue(self, epi, acc, tile, n0, tCcC, mD, mD_raw, done):
        """Rows past the group's live rows are zero; a tile that ends inside the output before
        its last row (a group shorter than a tile) stores row by row; returns the count of
        tiles stored by TMA."""
        if cutlass.const_expr(self.grouping != "contiguous"):
            # masked: rows past the live rows are zero; contiguous tiles store no such rows.
            # (Kgrouped tiles have none either, but the 64-row kgrouped configs spill without
            # this select: ptxas' choice.)
            for v in cutlass.range_constexpr(cute.size(acc)):
                acc[v] = cutlass.select_(tCcC[v][0] < tile.live, acc[v], cutlass.Float32(0.0))
        n_size = cute.size(mD, mode=[1])
        rows = cutlass.min(tile.rows, self.tile_m)
        if rows < self.tile_m and tile.row0 + rows < cute.size(mD_raw, mode=[0]):
            store_direct(acc, tCcC, mD_raw, tile.row0, n0, rows, n_size)
        else:
            gD_tile = cute.local_tile(cute.domain_offset((tile.row0, 0), mD), (self.tile_m, self.tile_n),
                                      (0, tile.n_tile))
            epi.store([gD_tile], done)
            done = done + 1
        return done
