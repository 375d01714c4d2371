"""CuTe DSL building blocks shared by the package's kernels (no torch import anywhere below).

Arch-neutral:
    ``utils``           ``round_up``, ``fence_operand`` (pin an accumulator's registers)
    ``tile_scheduler``  the persistent tile walk: dense (the wheel's static scheduler) and the
                        grouped modes (contiguous / masked / K-grouped) behind one interface,
                        driven the same way by producer and consumer warps
    ``fp8_block``       1x128 FP8 block quantization in registers (quantize and MoE kernels)
    ``pdl``             programmatic dependent launch: wait for the previous grid
sm_90a (``lowprec.cute.sm90``):
    ``tma_ring``        the TMA-filled shared-memory ring; a stage carries any list of TMA loads
                        (tiles plus their scales), issued once per step by ``TmaRing.fill``
    ``mma``             one wgmma batch into a fresh register accumulator (``BlockMma``)
    ``scales``          scale tiles: staged smem layouts, TMA boxes, reading a stage's scales
                        into registers at the positions of a wgmma accumulator
    ``promote``         FP32 promotion ``acc += blk * row_scale * col_scale`` of a wgmma
                        accumulator (per-column and per-128-column-block scale forms)
    ``epilogue``        bias, register -> smem -> TMA store, direct (masked) stores; a tile's
                        TMA stores issued by a warp outside the consumer warpgroups
                        (``TmaStoreWarp``: they never wait for each other or for the stores)
"""
