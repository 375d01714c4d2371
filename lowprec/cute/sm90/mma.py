"""One wgmma batch (a K block of a ring stage) into a fresh register accumulator."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from ..utils import LoopInvariant

__all__ = ["BlockMma"]


class BlockMma(LoopInvariant):
    """A warpgroup's wgmma over one ring stage: ``issue(acc, stage)`` computes the stage's
    A tile x B tile into ``acc`` (ACCUMULATE off on the first instruction: ``acc`` need not be
    zeroed) asynchronously; wait with ``cute.nvgpu.warpgroup.wait_group``.

    ``make_tiled_mma``: builds a fresh ``TiledMma`` of the kernel's kind; two are made with the
    ACCUMULATE field fixed once, outside all staged control flow (mutating one object inside
    loop / if regions makes values escape their region)."""

    def __init__(self, mma_zero, mma_acc, frag_a, frag_b):
        self.mma_zero, self.mma_acc, self.frag_a, self.frag_b = mma_zero, mma_acc, frag_a, frag_b

    @staticmethod
    def create(make_tiled_mma, tiled_mma, sA, sB, wg_thread0):
        """``sA``, ``sB``: staged smem tiles; ``wg_thread0``: the warpgroup's first thread index
        among the MMA threads."""
        thr = tiled_mma.get_slice(wg_thread0)
        frag_a = tiled_mma.make_fragment_A(thr.partition_A(sA))
        frag_b = tiled_mma.make_fragment_B(thr.partition_B(sB))
        mma_zero = make_tiled_mma()
        mma_zero.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        mma_acc = make_tiled_mma()
        mma_acc.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        return BlockMma(mma_zero, mma_acc, frag_a, frag_b)

    @cute.jit
    def issue(self, acc: cute.Tensor, stage):
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(self.frag_a, mode=[2])):
            kcoord = (None, None, kb, stage)
            mma = self.mma_zero if kb == 0 else self.mma_acc
            cute.gemm(mma, acc, self.frag_a[kcoord], self.frag_b[kcoord], acc)
        cute.nvgpu.warpgroup.commit_group()
