"""Persistent tile schedulers: which output tiles a CTA computes, in which order.

Every role of a CTA (the TMA producer warp, the MMA consumer warpgroups) walks the same tiles in
the same order, so each drives its own copy of the scheduler the same way::

    sched = SomeScheduler.create(...)
    while sched.is_valid():
        if sched.has_tile():
            tile = sched.work_tile()      # WorkTile: coordinates, group, rows, K blocks
            ...                           # load / compute / store the tile
            sched.advance()
        else:
            sched.next_group()            # grouped walks only

The walk is flat (one loop, a step is either a tile or a move to the next group) so that the
same loop serves a dense GEMM, whose ``has_tile()`` is always true, and the grouped walks, whose
group sizes are read on the device. A scheduler carries its dynamic state through the DSL's
loops itself (``__extract_mlir_values__``): keep the calls on a local name inside the loop body.

Modes:
    ``DenseTileScheduler``    the wheel's static persistent scheduler over (M tiles, N tiles,
                              K splits) with its swizzle / raster order; split s of S gets a
                              contiguous slice of ceil(K blocks / S) K blocks
    ``GroupedTileScheduler``  the grouped walks: "contiguous" (groups of rows of A given by
                              cumulative ends, plus the zero tail after the last group),
                              "masked" (E groups of M_max rows, counts[e] of them live),
                              "kgrouped" (E groups of K blocks, each a full output of N_out rows)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
from cutlass.cutlass_dsl import Int32, extract_mlir_values, new_from_mlir_values

__all__ = ["WorkTile", "DenseTileScheduler", "GroupedTileScheduler", "GROUPINGS"]

GROUPINGS = ("contiguous", "masked", "kgrouped")


class WorkTile:
    """One tile of a walk (built inside the tile branch; not carried across loop iterations).

    ``m_tile``, ``n_tile``: tile coordinates (``n_tile`` counts tile_n-wide tiles of the output),
    ``n0``: the tile's first output column;
    ``k_first``, ``k_cnt``: the K blocks to accumulate; ``coord``: the dense scheduler's
    (m, n, split) tile coordinate. Grouped walks also give ``group``, ``row0`` (first output row
    of the tile), ``row_off`` (its offset inside the group), ``rows`` (the group's rows from
    ``row_off`` on) and ``live`` (of those, rows that hold data; the others are zero).
    """

    def __init__(self, m_tile, n_tile, n0, k_first, k_cnt, coord=None, group=None, row0=None, row_off=None,
                 rows=None, live=None):
        self.m_tile, self.n_tile, self.n0 = m_tile, n_tile, n0
        self.k_first, self.k_cnt = k_first, k_cnt
        self.coord = coord
        self.group, self.row0, self.row_off, self.rows, self.live = group, row0, row_off, rows, live


class DenseTileScheduler:
    """The wheel's ``StaticPersistentTileScheduler`` behind the walk interface (its own tile
    order, swizzle and clusters; a hand-written walk measured ~3% slower, NOTES "tile-walk")."""

    def __init__(self, sched, work, tile_n: int, k_tile_cnt, split_k: int):
        self._sched, self._work = sched, work
        self._tile_n, self._k_tile_cnt, self._split_k = tile_n, k_tile_cnt, split_k

    @staticmethod
    def params(num_tiles_mnl, cluster_shape_mn, swizzle: int, raster_along_m: bool):
        return utils.PersistentTileSchedulerParams(num_tiles_mnl, (*cluster_shape_mn, 1), swizzle, raster_along_m)

    @staticmethod
    def grid(params, max_active_clusters: int):
        return utils.StaticPersistentTileScheduler.get_grid_shape(params, max_active_clusters)

    @staticmethod
    def create(params, tile_n: int, k_tile_cnt, split_k: int):
        """``k_tile_cnt``: K blocks of the problem; ``split_k``: K splits (tile coordinate 2)."""
        sched = utils.StaticPersistentTileScheduler.create(params, cute.arch.block_idx(), cute.arch.grid_dim())
        return DenseTileScheduler(sched, sched.initial_work_tile_info(), tile_n, k_tile_cnt, split_k)

    def is_valid(self):
        return self._work.is_valid_tile

    def has_tile(self):
        return True

    @cute.jit
    def work_tile(self) -> WorkTile:
        coord = self._work.tile_idx
        n0 = coord[1] * self._tile_n
        k_first = 0
        k_cnt = self._k_tile_cnt
        if cutlass.const_expr(self._split_k > 1):
            per = (self._k_tile_cnt + self._split_k - 1) // self._split_k
            k_first = coord[2] * per
            k_cnt = cutlass.min(per, self._k_tile_cnt - k_first)
        return WorkTile(coord[0], coord[1], n0, k_first, k_cnt, coord=coord)

    @cute.jit
    def advance(self):
        self._sched.advance_to_next_work()
        self._work = self._sched.get_current_work()

    def next_group(self):
        pass

    @property
    def num_tiles_executed(self):
        return self._sched.num_tiles_executed

    def __extract_mlir_values__(self):
        return extract_mlir_values(self._work) + extract_mlir_values(self._sched)

    def __new_from_mlir_values__(self, values):
        n = len(extract_mlir_values(self._work))
        return DenseTileScheduler(new_from_mlir_values(self._sched, values[n:]),
                                  new_from_mlir_values(self._work, values[:n]), self._tile_n, self._k_tile_cnt,
                                  self._split_k)


class GroupedTileScheduler:
    """Tiles of E independent GEMMs whose sizes are read on the device (``groups``: int32 [E]).

    The walk enumerates (M tile, cluster-wide N tile) pairs of every group, N outer and M inner;
    a cluster of 1 x c CTAs takes one index (grid z) and its CTAs the c neighbouring N tiles
    (grid y: the rank), so they load the same A tile (multicast). The N tile count must be a
    multiple of c. A partial last M tile of a group of at least one tile is moved back to end at
    the group's end: its first rows repeat the previous tile's (the same bits: each element's K
    order is the same), and the whole tile can be stored by TMA without touching the next
    group's rows; only groups shorter than a tile end inside a tile (``rows < tile_m``).

    ``m_size``: output rows; ``n_size``: output columns (per group); ``m_max``: rows per group
    of the masked layout, the output rows N_out per group for "kgrouped"; ``k_tile_cnt``: K
    blocks of every tile (not "kgrouped": there ends[e-1]/128 .. ends[e]/128, ends multiples of
    128).
    """

    _STATE = ("t", "base", "e", "g_start", "g_rows", "g_live", "g_tiles_m")

    def __init__(self, mode: str, groups, tile_mnk: tuple, cluster_n: int, m_size, n_size, m_max,
                 k_tile_cnt, n_groups, step, rank_n, walk_n, state):
        assert mode in GROUPINGS, mode
        self.mode, self.groups, self.cluster_n = mode, groups, cluster_n
        self.tile_m, self.tile_n, self.tile_k = tile_mnk
        self.m_size, self.n_size, self.m_max, self.k_tile_cnt = m_size, n_size, m_max, k_tile_cnt
        self.n_groups, self.step, self.rank_n, self.walk_n = n_groups, step, rank_n, walk_n
        self.t, self.base, self.e, self.g_start, self.g_rows, self.g_live, self.g_tiles_m = state

    @staticmethod
    def grid(cluster_n: int, num_sms: int):
        """Launch grid: one cluster id per z index (the tile count is known on the device only)."""
        return (1, cluster_n, num_sms // cluster_n)

    @staticmethod
    def create(mode: str, groups, tile_mnk: tuple, cluster_n: int, m_size, n_size, m_max, k_tile_cnt):
        """``tile_mnk``: (tile_m, tile_n, K block); ``cluster_n``: CTAs per cluster along N."""
        walk_n = (n_size + tile_mnk[1] - 1) // tile_mnk[1] // cluster_n
        n_groups = cute.size(groups, mode=[0])
        if cutlass.const_expr(mode == "contiguous"):
            n_groups = n_groups + 1  # the zero tail after the last group
        bidx = cute.arch.block_idx()
        sched = GroupedTileScheduler(mode, groups, tile_mnk, cluster_n, m_size, n_size, m_max, k_tile_cnt,
                                     n_groups, cute.arch.grid_dim()[2], bidx[1], walk_n,
                                     (bidx[2], Int32(0), Int32(0), None, None, None, None))
        sched._enter_group()
        return sched

    def is_valid(self):
        return self.e < self.n_groups

    def has_tile(self):
        return self.t < self.base + self.g_tiles_m * self.walk_n

    @cute.jit
    def work_tile(self) -> WorkTile:
        local = self.t - self.base
        m_tile = local % self.g_tiles_m
        n_tile = (local // self.g_tiles_m) * self.cluster_n + self.rank_n
        n0 = n_tile * self.tile_n
        off = m_tile * self.tile_m
        if cutlass.const_expr(self.mode != "kgrouped"):  # kgrouped tiles are all full
            if off + self.tile_m > self.g_rows and self.g_rows >= self.tile_m:
                off = self.g_rows - self.tile_m
        live = self.g_live - off
        k_first, k_cnt = self._k_range(live)
        return WorkTile(m_tile, n_tile, n0, k_first, k_cnt, group=self.e, row0=self.g_start + off, row_off=off,
                        rows=self.g_rows - off, live=live)

    def advance(self):
        self.t = self.t + self.step

    @cute.jit
    def next_group(self):
        self.base = self.base + self.g_tiles_m * self.walk_n
        self.e = self.e + 1
        self._enter_group()

    @cute.jit
    def _enter_group(self):
        self.g_start, self.g_rows, self.g_live = self._group_rows()
        self.g_tiles_m = (self.g_rows + self.tile_m - 1) // self.tile_m

    @cute.jit
    def _group_rows(self):
        """(first row, rows, live rows) of group ``e``: rows are written, live rows computed
        (the others zero). Contiguous: rows ends[e-1]:ends[e], all live; group E is the tail
        ends[E-1]:M with none live. Masked: rows e*M_max:(e+1)*M_max, counts[e] live.
        K-grouped: rows e*N_out:(e+1)*N_out, all live."""
        e = self.e
        num_e = cute.size(self.groups, mode=[0])
        ec = cutlass.min(e, num_e - 1)
        if cutlass.const_expr(self.mode == "kgrouped"):
            return e * self.m_max, self.m_max, self.m_max
        if cutlass.const_expr(self.mode == "contiguous"):
            start = Int32(0)
            if e > 0:
                start = self.groups[cutlass.max(e - 1, 0)]
            end = self.m_size
            live_end = self.m_size
            if e < num_e:
                end = self.groups[ec]
            else:
                live_end = start
            return start, end - start, live_end - start
        return e * self.m_max, self.m_max, self.groups[ec]

    @cute.jit
    def _k_range(self, live):
        """(first K block, K blocks) of a tile with ``live`` live rows of group ``e``."""
        k_first = Int32(0)
        k_cnt = self.k_tile_cnt
        if cutlass.const_expr(self.mode == "kgrouped"):
            start = Int32(0)
            if self.e > 0:
                start = self.groups[self.e - 1]
            k_first = start // self.tile_k
            k_cnt = (self.groups[self.e] - start + self.tile_k - 1) // self.tile_k
        else:
            if live <= 0:
                k_cnt = 0
        return k_first, k_cnt

    def _state(self):
        return [getattr(self, f) for f in self._STATE]

    def __extract_mlir_values__(self):
        return extract_mlir_values(self._state())

    def __new_from_mlir_values__(self, values):
        state = new_from_mlir_values(self._state(), values)
        return GroupedTileScheduler(self.mode, self.groups, (self.tile_m, self.tile_n, self.tile_k), self.cluster_n,
                                    self.m_size,
                                    self.n_size, self.m_max, self.k_tile_cnt, self.n_groups, self.step, self.rank_n,
                                    self.walk_n, state)
