"""The split-KV combine of the FP8 attention forward (CuTe DSL, sm_90a): one launch.

Each split of the KV blocks wrote its normalized FP32 partial output ``O_i`` and its LSE ``l_i`` per
query row; the row's result is ``lse = log Σ_i exp(l_i)`` and ``O = Σ_i exp(l_i - lse) O_i`` (rows
whose splits all saw no key: 0 and -inf). In torch ops this was ~8 launches whose host time made
an eager split-KV decode call 3.7x slower than no split (NOTES.md, session 28). Here one row is
``D / 4`` threads, four FP32 values each (one 16-byte load per split).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ...cute.pdl import after_previous_grid

THREADS = 256


@cute.kernel
def _combine_kernel(mO: cute.Tensor, mL: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor, splits: cutlass.Int32,
                    d: cutlass.Constexpr, pdl: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    if cutlass.const_expr(pdl):
        after_previous_grid()
    bidx, _, _ = cute.arch.block_idx()
    lanes = d // 4
    row = bidx * (THREADS // lanes) + tidx // lanes
    lane = tidx % lanes
    if row < mL.shape[1]:
        m = Float32(-math.inf)
        for s in cutlass.range(splits, unroll=1):
            m = cute.arch.fmax(m, mL[s, row])
        m_safe = cutlass.select_(m == Float32(-math.inf), Float32(0.0), m)
        total = Float32(0.0)
        for s in cutlass.range(splits, unroll=1):
            total = total + cute.math.exp(mL[s, row] - m_safe, fastmath=False)
        lse = m_safe + cute.math.log(total, fastmath=False)  # no key in any split: log 0 = -inf
        lse_safe = cutlass.select_(total == Float32(0.0), Float32(0.0), lse)
        acc = cute.make_rmem_tensor((4,), Float32)
        acc.fill(0.0)
        for s in cutlass.range(splits, unroll=1):
            w = cute.math.exp(mL[s, row] - lse_safe, fastmath=False)
            part = cute.make_rmem_tensor((4,), Float32)
            cute.autovec_copy(cute.local_tile(mO[(s, row, None)], (4,), (lane,)), part)
            acc.store(acc.load() + part.load() * w)
        res = cute.make_rmem_tensor((4,), mOut.element_type)
        res.store(acc.load().to(mOut.element_type))
        cute.autovec_copy(res, cute.local_tile(mOut[(row, None)], (4,), (lane,)))
        if lane == 0:
            mLse[row] = cutlass.select_(total == Float32(0.0), Float32(-math.inf), lse)


@cute.jit
def combine_splits(mO: cute.Tensor, mL: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor, splits: cutlass.Int32,
                   d: cutlass.Constexpr, pdl: cutlass.Constexpr, stream):
    """``mO`` [splits, rows, D] FP32 partials and ``mL`` [splits, rows] their LSEs -> ``mOut``
    [rows, D] (bf16 / fp16) and ``mLse`` [rows]; ``pdl``: programmatic dependent launch."""
    rows_per_cta = THREADS // (d // 4)
    _combine_kernel(mO, mL, mOut, mLse, splits, d, pdl).launch(
        grid=((mL.shape[1] + rows_per_cta - 1) // rows_per_cta, 1, 1), block=(THREADS, 1, 1), stream=stream,
        use_pdl=pdl)
