"""Epilogues of a wgmma accumulator: a bias per column, the TMA store through shared memory, and
a direct (row-masked) store from registers."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils

from ..utils import LoopInvariant

__all__ = ["add_col_vector", "store_direct", "TmaStoreEpilogue", "TmaStoreWarp"]


@cute.jit
def add_col_vector(acc: cute.Tensor, vec: cute.Tensor, col0, n_limit):
    """acc[row, col] += vec[col] for a wgmma fragment whose thread's first column is ``col0``
    (value ``c + 2r + 4j`` at column ``col0 + 8j + c``); columns past ``n_limit`` read the last
    element (their values are not stored)."""
    for j in cutlass.range_constexpr(cute.size(acc) // 4):
        for c in cutlass.range_constexpr(2):
            bcol = cutlass.min(col0 + 8 * j + c, n_limit - 1)
            bval = vec[bcol].to(acc.element_type)
            for r in cutlass.range_constexpr(2):
                v = c + 2 * r + 4 * j
                acc[v] = acc[v] + bval


@cute.jit
def store_direct(acc: cute.Tensor, coords: cute.Tensor, mD: cute.Tensor, row0, n0, rows, n_size):
    """Store a tile's first ``rows`` rows (and columns below ``n_size``) straight from registers
    into ``mD`` at (row0, n0); ``coords``: the tile coordinates of the fragment's values."""
    for v in cutlass.range_constexpr(cute.size(acc)):
        r = coords[v][0]
        col = n0 + coords[v][1]
        if r < rows and col < n_size:
            mD[(row0 + r, col)] = acc[v].to(mD.element_type)


def _tile_slices(tma_atom, sD, epi_tile, gD_tile):
    """(smem slices, gmem slices, count, gmem coordinate layout) of a tile stored ``epi_tile`` by
    ``epi_tile`` through the staged buffers ``sD``."""
    tDgD = cute.zipped_divide(gD_tile, epi_tile)
    bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2),
                                                      tDgD)
    shape = tDgD.shape[1]
    return bSG_sD, bSG_gD, cute.size(tDgD, mode=[1]), cute.make_layout(shape, stride=(shape[1], 1))


@cute.jit
def _issue_whole(tma_atom, parts: list):
    """The TMA stores of a tile staged whole: wave w's slices from buffers ``w * count ..``;
    ``parts``: :func:`_tile_slices` of each wave's gmem tile."""
    for w in cutlass.range_constexpr(len(parts)):
        bSG_sD, bSG_gD, num, coords = parts[w]
        for epi_idx in cutlass.range_constexpr(num):
            cute.copy(tma_atom, bSG_sD[(None, w * num + epi_idx)], bSG_gD[(None, coords.get_hier_coord(epi_idx))])


class TmaStoreEpilogue(LoopInvariant):
    """Accumulators -> out dtype -> smem (``stmatrix``) -> gmem (TMA store), ``epi_tile`` by
    ``epi_tile``, through ``epi_stage`` staged smem buffers. ``accs``: one accumulator per wave
    (a wave: the rows one pass of the tiled MMA covers; a tile of several waves stores each into
    its own gmem sub-tile).

    A tile that fits the buffers whole is staged whole: one barrier pair per tile (the previous
    tile's stores were issued a mainloop ago: waiting for their smem reads costs nothing).
    Otherwise one pair per slice, the buffers used round robin across tiles (``tiles_done``).
    ``barrier``: a named barrier of all the storing threads; ``store_warp``: the warp issuing
    the TMA stores."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    @staticmethod
    def create(tiled_mma, accs: list, sD, tma_atom, tidx, warp_idx, out_dtype, d_layout, epi_tile, epi_stage: int,
               store_warp: int, barrier, num_threads: int):
        acc_dtype = accs[0].element_type
        copy_atom_r2s = sm90_utils.get_smem_store_op(d_layout, elem_ty_d=out_dtype, elem_ty_acc=acc_dtype)
        copy_atom_c = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(d_layout.is_m_major_c(), 4), out_dtype
        )
        tiled_copy_c_atom = cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma)
        tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, tiled_copy_c_atom)
        thr_copy_r2s = tiled_copy_r2s.get_slice(tidx)
        tRS_sD = thr_copy_r2s.partition_D(sD)
        tRS_rAccs = [tiled_copy_r2s.retile(acc) for acc in accs]
        rD_shape = cute.shape(thr_copy_r2s.partition_S(sD))
        tRS_rD = cute.make_rmem_tensor(rD_shape[:3], acc_dtype)
        tRS_rD_out = cute.make_rmem_tensor(rD_shape[:3], out_dtype)
        store_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=epi_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_threads),
        )
        return TmaStoreEpilogue(
            tiled_copy_r2s=tiled_copy_r2s, tRS_rAccs=tRS_rAccs, tRS_rD=tRS_rD, tRS_rD_out=tRS_rD_out, tRS_sD=tRS_sD,
            sD=sD, tma_atom=tma_atom, store_pipeline=store_pipeline, warp_idx=warp_idx, out_dtype=out_dtype,
            epi_tile=epi_tile, epi_stage=epi_stage, store_warp=store_warp, barrier=barrier,
        )

    def _slices(self, gD_tile):
        return _tile_slices(self.tma_atom, self.sD, self.epi_tile, gD_tile)

    @cute.jit
    def _to_smem(self, wave: cutlass.Constexpr, epi_idx: cutlass.Constexpr, buffer):
        """Slice ``epi_idx`` of wave ``wave``'s accumulator, converted, into smem buffer ``buffer``."""
        n = cute.size(self.tRS_rD)
        for epi_v in cutlass.range_constexpr(n):
            self.tRS_rD[epi_v] = self.tRS_rAccs[wave][epi_idx * n + epi_v]
        self.tRS_rD_out.store(self.tRS_rD.load().to(self.out_dtype))
        cute.copy(self.tiled_copy_r2s, self.tRS_rD_out, self.tRS_sD[(None, None, None, buffer)])

    @cute.jit
    def store(self, gD_tiles: list, tiles_done):
        """Store the accumulators (one per wave) to ``gD_tiles`` (one gmem tile per wave);
        ``tiles_done``: tiles this epilogue stored before (picks the buffers of a tile stored
        slice by slice)."""
        parts = [self._slices(g) for g in gD_tiles]
        num = parts[0][2]
        waves = len(parts)
        if cutlass.const_expr(num * waves <= self.epi_stage):
            if self.warp_idx == self.store_warp:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            self.barrier.arrive_and_wait()
            self._stage_whole(num)
            self.barrier.arrive_and_wait()
            if self.warp_idx == self.store_warp:
                _issue_whole(self.tma_atom, parts)
                self.store_pipeline.producer_commit()
        else:
            for w in cutlass.range_constexpr(waves):
                bSG_sD, bSG_gD, _, coords = parts[w]
                for epi_idx in cutlass.range_constexpr(num):
                    buffer = (tiles_done * num * waves + w * num + epi_idx) % self.epi_stage
                    self._to_smem(w, epi_idx, buffer)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    self.barrier.arrive_and_wait()
                    gmem_coord = coords.get_hier_coord(epi_idx)
                    if self.warp_idx == self.store_warp:
                        cute.copy(self.tma_atom, bSG_sD[(None, buffer)], bSG_gD[(None, gmem_coord)])
                        self.store_pipeline.producer_commit()
                        self.store_pipeline.producer_acquire()
                    self.barrier.arrive_and_wait()

    @cute.jit
    def write_for_store_warp(self, slices: cutlass.Constexpr, free, full):
        """The consumers' half of a tile that a :class:`TmaStoreWarp` stores: wait until the
        buffers are ``free`` (the previous tile's stores have read them; issued a mainloop ago, so
        at once), write the ``slices`` slices of every wave's accumulator, fence them to the
        async proxy and signal ``full`` without waiting: no consumer waits for another one or
        for the stores to be issued."""
        free.arrive_and_wait()
        self._stage_whole(slices)
        full.arrive()

    @cute.jit
    def _stage_whole(self, slices: cutlass.Constexpr):
        """Every wave's ``slices`` slices into buffers ``w * slices ..``, fenced to the async proxy."""
        for w in cutlass.range_constexpr(len(self.tRS_rAccs)):
            for epi_idx in cutlass.range_constexpr(slices):
                self._to_smem(w, epi_idx, w * slices + epi_idx)
        cute.arch.fence_proxy("async.shared", space="cta")

    def tail(self):
        """Wait for the last TMA stores (before the CTA exits)."""
        self.store_pipeline.producer_tail()


class TmaStoreWarp(LoopInvariant):
    """A warp outside the consumer warpgroups that issues each tile's TMA stores: it frees the
    staged smem buffers for the next tile once the previous tile's stores have read them
    (``free``), waits until the consumers have written the tile (``full``) and stores it,
    one buffer per slice, as :meth:`TmaStoreEpilogue.store` stages a whole tile. ``free`` and
    ``full``: named barriers of the consumer threads and this warp (the consumers use
    :meth:`TmaStoreEpilogue.write_for_store_warp`)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    @staticmethod
    def create(sD, tma_atom, epi_tile, free, full):
        store_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=1, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32))
        return TmaStoreWarp(sD=sD, tma_atom=tma_atom, epi_tile=epi_tile, free=free, full=full,
                            store_pipeline=store_pipeline)

    @cute.jit
    def store(self, gD_tiles: list):
        """One tile: ``gD_tiles``, one gmem tile per wave, from the buffers the consumers wrote."""
        cute.arch.cp_async_bulk_wait_group(0, read=True)
        self.free.arrive()
        self.full.arrive_and_wait()
        _issue_whole(self.tma_atom, [_tile_slices(self.tma_atom, self.sD, self.epi_tile, g) for g in gD_tiles])
        self.store_pipeline.producer_commit()

    def tail(self):
        """Wait for the last TMA stores (before the CTA exits)."""
        self.store_pipeline.producer_tail()
