"""The consumer's K loop of the block-scaled GEMM: per K block a wgmma batch into a fresh block
accumulator, the block's scales, FP32 promotion into ``acc`` (composed of ``lowprec.cute.sm90``).

A tile of several waves (a wave: the rows one pass of the tiled MMA covers; e.g. 256-row tiles of
two 128-row waves) runs the waves of a K block one after the other into one block accumulator,
each waited for and promoted into its own ``acc`` (DeepGEMM's 256-row tiles: the two consumer
warpgroups' promotions interleave with each other's wgmmas), its K loop unrolled over the ring's
stages. With one wave and ``overlap`` two
block accumulators alternate, so the wgmma batch of block k+1 runs while
block k is promoted (``wait_group(1)``, operands pinned by ``fence_operand``); otherwise each
block is waited for (``wait_group(0)``). ``sb_from_smem``: 1x128 B scales on tiles over 64
columns (16x128 ones on 64-row tiles) are read from the stage at promotion (the stage released
after it) instead of being held in registers from the issue on, so that the second block
accumulator fits. Tiles that can
straddle two 128-wide scale blocks get one copy of the K loop per possible split column when
not overlapped (:meth:`PromotedMainloop.run`), so each column group's scale block is known when
tracing.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

from ...cute.sm90.promote import promote_col_blocks, promote_per_col
from ...cute.sm90.scales import FragmentScales, ScaleRegs
from ...cute.utils import LoopInvariant, fence_operand
from .config import SCALE_BLOCK

__all__ = ["KSlot", "Wave", "PromotedMainloop"]


class Wave(LoopInvariant):
    """One wave of a tile: its ``BlockMma``, the thread's ``FragmentScales`` and FP32 ``acc``."""

    def __init__(self, mma, scales: FragmentScales, acc):
        self.mma, self.scales, self.acc = mma, scales, acc


class KSlot(LoopInvariant):
    """A block accumulator with the register copies of its K block's scales."""

    def __init__(self, blk: cute.Tensor, regs: ScaleRegs):
        self.blk, self.regs = blk, regs


class PromotedMainloop(LoopInvariant):
    """``ring``: the TMA ring; ``waves``: the tile's ``Wave``s; ``slots``: one or two ``KSlot``
    (one with several waves)."""

    def __init__(self, ring, waves: list, slots, *, overlap: bool, sb_from_smem: bool,
                 per_col: bool, n_straddle: bool, tile_n: int, col_group: int = 1):
        assert len(waves) == 1 or not (overlap or sb_from_smem), "several waves: no overlap, scales in registers"
        self.ring, self.waves, self.slots = ring, waves, slots
        self.mma, self.scales, self.acc = waves[0].mma, waves[0].scales, waves[0].acc
        self.overlap, self.sb_from_smem, self.per_col = overlap, sb_from_smem, per_col
        self.n_straddle, self.tile_n, self.col_group = n_straddle, tile_n, col_group

    def shifted(self, dr):
        """The same loop, A's row scales read ``dr`` rows further into the stage's box."""
        return PromotedMainloop(self.ring, [Wave(w.mma, w.scales.shifted(dr), w.acc) for w in self.waves],
                                self.slots, overlap=self.overlap, sb_from_smem=self.sb_from_smem,
                                per_col=self.per_col, n_straddle=self.n_straddle, tile_n=self.tile_n,
                                col_group=self.col_group)

    @cute.jit
    def run(self, n0, k_first, k_cnt, read_state, release_state):
        """``acc`` (zeroed by the caller) += the promoted products of K blocks k_first ..
        k_first+k_cnt-1 (k_cnt >= 1) of the tile at column ``n0``; returns the advanced states
        (reassign them, so that the caller's dynamic loop carries them)."""
        # first column (tile-relative) that belongs to the next 128-wide scale block
        split = (n0 // SCALE_BLOCK + 1) * SCALE_BLOCK - n0
        if cutlass.const_expr(self.n_straddle and not self.per_col and not self.overlap):
            # one copy of the loop per value split can take (tiles start at multiples of tile_n):
            # no selects per column group and K block (19% of the stall samples of 128x160).
            # Not overlapped loops: unmeasured there, and 8 copies of the 2x-unrolled body take
            # 5x as long to compile (64x112: 1.7 -> 9 s)
            step = math.gcd(self.tile_n, SCALE_BLOCK)
            for split_c in cutlass.range_constexpr(step, SCALE_BLOCK + 1, step):
                if split == split_c:
                    read_state, release_state = self._run_at(split_c, k_first, k_cnt, read_state, release_state)
        else:
            read_state, release_state = self._run_at(split, k_first, k_cnt, read_state, release_state)
        return read_state, release_state

    @cute.jit
    def _run_at(self, split, k_first, k_cnt, read_state, release_state):
        if cutlass.const_expr(len(self.waves) > 1):
            read_state, release_state = self._run_waves(split, k_first, k_cnt, read_state, release_state)
        elif cutlass.const_expr(self.overlap):
            read_state, release_state = self._run_overlapped(split, k_first, k_cnt, read_state, release_state)
        else:
            s0 = self.slots[0]
            for k_tile in range(k_cnt):
                # NB: pipeline-state updates stay in this loop body (``x.advance()``)
                # so that the DSL carries the states through the dynamic loop / if regions.
                self._issue(s0, read_state, k_first + k_tile)
                cute.nvgpu.warpgroup.wait_group(0)
                self.ring.release(read_state)
                read_state.advance()
                release_state.advance()
                self._promote(s0, split)
        return read_state, release_state

    @cute.jit
    def _waves_block(self, state, k, split):
        """One K block of a several-wave tile from the stage of ``state``: per wave its scales,
        its wgmma batch into the shared block accumulator, the wait, its promotion; the stage
        is released before the last wave's promotion."""
        s0 = self.slots[0]
        self.ring.wait(state)
        for w in cutlass.range_constexpr(len(self.waves)):
            wave = self.waves[w]
            # scales read before the wgmma batch: issued after it, the loads queue behind
            # its shared-memory operand reads and the promotion waits for them. The waves share
            # the tile's columns: 1x128 B scales (tile_n / 4 per thread) are read by the first
            # wave only (they are what bounds that kind: NOTES, session 11)
            wave.scales.load(state.index, k, s0.regs, cols=w == 0 or not self.per_col)
            wave.mma.issue(s0.blk, state.index)
            cute.nvgpu.warpgroup.wait_group(0)
            if cutlass.const_expr(w == len(self.waves) - 1):
                self.ring.release(state)
            self._promote(s0, split, wave.acc)

    @cute.jit
    def _run_waves(self, split, k_first, k_cnt, read_state, release_state):
        """The several-wave loop with the stage index a constant (DeepGEMM's K loop): blocks up
        to the ring's wrap one at a time, then groups of ``num_stages`` blocks, stage s of a
        group at stage s, so that every wgmma descriptor, scale and barrier address is the
        loop-invariant base plus a constant (+2-5.6% at the 256x128 shapes, NOTES session 33);
        then the rest one at a time."""
        stages = self.ring.num_stages
        head = cutlass.min((stages - read_state.index) % stages, k_cnt)
        for k_tile in range(head):
            self._waves_block(read_state, k_first + k_tile, split)
            read_state.advance()
            release_state.advance()
        groups = (k_cnt - head) // stages
        for g in range(groups):
            k0 = k_first + head + g * stages
            for s in cutlass.range_constexpr(stages):
                self._waves_block(pipeline.PipelineState(stages, read_state.count, s, read_state.phase), k0 + s,
                                  split)
            # a whole turn of the ring: the index is back at 0, the phase flipped
            read_state = pipeline.PipelineState(stages, read_state.count + stages, read_state.index,
                                                read_state.phase ^ 1)
            release_state = pipeline.PipelineState(stages, release_state.count + stages, release_state.index,
                                                   release_state.phase ^ 1)
        for k_tile in range(head + groups * stages, k_cnt):
            self._waves_block(read_state, k_first + k_tile, split)
            read_state.advance()
            release_state.advance()
        return read_state, release_state

    @cute.jit
    def _run_overlapped(self, split, k_first, k_cnt, read_state, release_state):
        """Software pipeline over K blocks: entry and exit of each steady iteration have one block
        in flight in slot 0 (even blocks); straight-line body (keeps ptxas' wgmma register
        analysis exact). Block k's scales are read right after its wgmma is issued."""
        s0, s1 = self.slots
        fence_operand(s0.blk)
        self._issue(s0, read_state, k_first)
        read_state.advance()
        for j in range((k_cnt - 1) // 2):
            release_state, read_state = self._step(s1, s0, k_first + 2 * j + 1, split, read_state, release_state)
            fence_operand(self.acc)
            release_state, read_state = self._step(s0, s1, k_first + 2 * j + 2, split, read_state, release_state)
            fence_operand(self.acc)
        # tail: the block in slot 0, plus one more block when k_cnt is even
        if k_cnt % 2 == 0:
            release_state, read_state = self._step(s1, s0, k_first + k_cnt - 1, split, read_state, release_state)
            cute.nvgpu.warpgroup.wait_group(0)
            fence_operand(s1.blk)
            release_state = self._retire(s1, split, release_state)
        else:
            cute.nvgpu.warpgroup.wait_group(0)
            fence_operand(s0.blk)
            release_state = self._retire(s0, split, release_state)
        return read_state, release_state

    @cute.jit
    def _step(self, nxt: KSlot, done: KSlot, k, split, read_state, release_state):
        """Issue K block ``k`` into ``nxt``, then promote the block in flight in ``done``."""
        fence_operand(nxt.blk)
        self._issue(nxt, read_state, k)
        read_state.advance()
        cute.nvgpu.warpgroup.wait_group(1)
        fence_operand(done.blk)
        release_state = self._retire(done, split, release_state)
        return release_state, read_state

    @cute.jit
    def _issue(self, slot: KSlot, read_state, k):
        """Wait for the stage of ``read_state``, issue its wgmma batch into ``slot.blk``
        (asynchronous) and copy K block ``k``'s scales from the stage to ``slot.regs``."""
        self.ring.wait(read_state)
        self.mma.issue(slot.blk, read_state.index)
        if cutlass.const_expr(not self.sb_from_smem):  # else read at promotion (_retire)
            self.scales.load(read_state.index, k, slot.regs)

    @cute.jit
    def _retire(self, slot: KSlot, split, release_state):
        """Promote a finished block and release its stage: after the promotion when its scales
        are read from the stage (``sb_from_smem``), else first. Returns the advanced state."""
        if cutlass.const_expr(self.sb_from_smem):
            stage = release_state.index
            sc = self.scales
            rows = [sc.row(stage, r) for r in range(2)]
            if cutlass.const_expr(self.col_group > 1):
                groups = self.tile_n // self.col_group
                promote_col_blocks(self.acc, slot.blk, rows, [sc.group(stage, i) for i in range(groups)],
                                   groups, 0, False, self.col_group)
            else:
                promote_per_col(self.acc, slot.blk, rows, lambda j, c: sc.col(stage, j, c))
            self.ring.release(release_state)
            release_state.advance()
        else:
            self.ring.release(release_state)
            release_state.advance()
            self._promote(slot, split)
        return release_state

    @cute.jit
    def _promote(self, slot: KSlot, split, acc=None):
        acc = self.acc if acc is None else acc
        regs = slot.regs
        if cutlass.const_expr(self.per_col and self.col_group > 1):
            # 16x128 B blocks: one product per (row, column group), then one FFMA per value
            promote_col_blocks(acc, slot.blk, regs.row, regs.col, self.tile_n // self.col_group, 0, False,
                               self.col_group)
        elif cutlass.const_expr(self.per_col):
            promote_per_col(acc, slot.blk, regs.row, lambda j, c: regs.col[2 * j + c])
        else:
            promote_col_blocks(acc, slot.blk, regs.row, regs.col, len(self.scales.s_col), split,
                               self.n_straddle, SCALE_BLOCK)
