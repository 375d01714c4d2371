"""The TMA-filled shared-memory ring of a warp-specialised sm_90a kernel.

A ring of ``num_stages`` stages, each holding the operands of one step of the consumer's loop
(a GEMM: one K block's A and B tiles plus their scales; attention: a K or V tile plus its
scales). One producer thread fills a stage with TMA loads that all complete on the stage's
mbarrier (one transaction of ``stage_bytes``); the consumers wait on it, read, and release it.
What a stage carries is a list of :class:`TmaLoad`, so the producer's per-step issue is written
once (:meth:`TmaRing.fill`) whatever the operands are.

Pipeline states (``pipeline.PipelineState``) stay with the caller: advance them in the body of
the caller's loop (``state.advance()``), where the DSL sees them change and carries them.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values

from ..utils import LoopInvariant

__all__ = ["TmaLoad", "TmaRing", "tma_partition_tiles"]


def tma_partition_tiles(atom, smem, gmem, cta_coord=0, cta_layout=None):
    """(smem partition (TMA, stage), gmem partition (TMA, rest...)) of one TMA load: ``smem``
    and ``gmem`` tiled (tile modes first); ``cta_coord`` / ``cta_layout``: the CTA's place in a
    multicast group (defaults: no multicast)."""
    if cta_layout is None:
        cta_layout = cute.make_layout(1)
    return cute.nvgpu.cpasync.tma_partition(
        atom, cta_coord, cta_layout, cute.group_modes(smem, 0, 2), cute.group_modes(gmem, 0, 2)
    )


class TmaLoad(LoopInvariant):
    """One TMA copy of every stage: ``src`` the gmem partition of this tile indexed by the step
    (``src[(None, step // step_div)]``), ``dst`` the stage buffers (``dst[(None, stage)]``),
    ``mcast_mask`` the CTAs of a multicast (None: none)."""

    def __init__(self, atom, src, dst, mcast_mask=None, step_div: int = 1):
        self.atom, self.src, self.dst, self.mcast_mask, self.step_div = atom, src, dst, mcast_mask, step_div

    @cute.jit
    def issue(self, step, stage, bar):
        src = self.src[(None, step)] if self.step_div == 1 else self.src[(None, step // self.step_div)]
        if cutlass.const_expr(self.mcast_mask is None):
            cute.copy(self.atom, src, self.dst[(None, stage)], tma_bar_ptr=bar)
        else:
            cute.copy(self.atom, src, self.dst[(None, stage)], tma_bar_ptr=bar, mcast_mask=self.mcast_mask)


class TmaRing:
    """A ``PipelineTmaAsync`` ring: one mbarrier transaction of ``stage_bytes`` per stage,
    released by ``consumer_threads`` arrivals (per CTA of the multicast group)."""

    def __init__(self, pipe, num_stages: int):
        self.pipe, self.num_stages = pipe, num_stages

    # carried through dynamic loops as its pipeline (barrier pointers)
    def __extract_mlir_values__(self):
        return extract_mlir_values(self.pipe)

    def __new_from_mlir_values__(self, values):
        return TmaRing(new_from_mlir_values(self.pipe, values), self.num_stages)

    @staticmethod
    def create(barrier_ptr, num_stages: int, stage_bytes: int, consumer_arrivals: int, cta_layout_vmnk):
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=barrier_ptr,
            num_stages=num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_arrivals),
            tx_count=stage_bytes,
            cta_layout_vmnk=cta_layout_vmnk,
            defer_sync=True,
        )
        return TmaRing(pipe, num_stages)

    def producer_state(self):
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)

    def consumer_state(self):
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)

    @cute.jit
    def fill(self, state, loads: list, step):
        """Producer: wait for the stage of ``state`` to be free, issue ``loads`` for ``step``
        into it, arm its barrier. The caller advances ``state``."""
        self.pipe.producer_acquire(state)
        bar = self.pipe.producer_get_barrier(state)
        for load in loads:
            load.issue(step, state.index, bar)
        self.pipe.producer_commit(state)

    def wait(self, state):
        """Consumer: wait until the stage of ``state`` is full."""
        self.pipe.consumer_wait(state)

    def release(self, state):
        """Consumer: hand the stage of ``state`` back to the producer."""
        self.pipe.consumer_release(state)

    def producer_tail(self, state):
        self.pipe.producer_tail(state)
