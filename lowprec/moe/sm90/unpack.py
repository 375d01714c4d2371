"""MoE unpack (the weighted combine of packed rows back to tokens) as one CuTe DSL kernel.

``out[t] = Σ_j weights[t, j] · rows[slot_rows[t, j]]``, bit-identical to
:func:`lowprec.moe.unpack`'s reference: FP32 accumulator from 0, slots in order ``j = 0..k-1``,
each product rounded before its add, dropped slots (``slot_rows == -1``) adding +0. The product
and the sum are inline ``mul.rn`` / ``add.rn``: an explicit rounding mode keeps ptxas (and LLVM,
which contracts ``fmul`` + ``fadd`` by default here) from fusing them into one FFMA.

Grid: one CTA row per token (``blockIdx.x``), 128 threads per 1024 columns (``blockIdx.y``);
each thread owns 8 columns. ``k`` is the slot map's static second dimension, so the loop unrolls
and the k 16-byte row loads are issued together. A dropped slot loads row 0 (its index clamped)
and selects +0 instead: no branch between the loads.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from ...cute.pdl import after_previous_grid

VEC = 8  # columns per thread: one 16-byte load of bf16 rows
THREADS = 128


def _f32_asm(asm: str, *args, loc=None, ip=None) -> Float32:
    operands = [Float32(a).ir_value(loc=loc, ip=ip) for a in args]
    return Float32(llvm.inline_asm(T.f32(), operands, asm, "=f" + ",f" * len(operands), has_side_effects=False,
                                   is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def mul_rn(a, b, *, loc=None, ip=None) -> Float32:
    """``a · b`` rounded to FP32, never fused with a following add."""
    return _f32_asm("mul.rn.f32 $0, $1, $2;", a, b, loc=loc, ip=ip)


@dsl_user_op
def add_rn(a, b, *, loc=None, ip=None) -> Float32:
    """``a + b`` rounded to FP32, never fused with a preceding multiply."""
    return _f32_asm("add.rn.f32 $0, $1, $2;", a, b, loc=loc, ip=ip)


@cute.kernel
def _unpack_kernel(mRows: cute.Tensor, mSlotRows: cute.Tensor, mWeights: cute.Tensor, mOut: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    after_previous_grid()
    token, chunk, _ = cute.arch.block_idx()
    col = (chunk * THREADS + tidx) * VEC
    top_k = mSlotRows.shape[1]
    if col < mOut.shape[1]:
        rows = []
        for j in cutlass.range_constexpr(top_k):
            src = cutlass.Int32(mSlotRows[token, j])
            frag = cute.make_rmem_tensor((1, VEC), mRows.element_type)
            cute.autovec_copy(cute.local_tile(mRows, (1, VEC), (cutlass.max(src, 0), col // VEC)), frag)
            rows.append((src >= 0, mWeights[token, j], frag.load().to(Float32)))
        acc = cute.make_rmem_tensor((1, VEC), Float32)
        acc.fill(0.0)
        for j in cutlass.range_constexpr(top_k):
            kept, w, values = rows[j]
            for i in cutlass.range_constexpr(VEC):
                term = mul_rn(values[i], w)
                acc[i] = add_rn(acc[i], cutlass.select_(kept, term, Float32(0.0)))
        out = cute.make_rmem_tensor((1, VEC), mOut.element_type)
        out.store(acc.load().to(mOut.element_type))
        cute.autovec_copy(out, cute.local_tile(mOut, (1, VEC), (token, col // VEC)))


@cute.jit
def unpack_rows(mRows: cute.Tensor, mSlotRows: cute.Tensor, mWeights: cute.Tensor, mOut: cute.Tensor, stream):
    chunks = (mOut.shape[1] // VEC + THREADS - 1) // THREADS
    _unpack_kernel(mRows, mSlotRows, mWeights, mOut).launch(
        grid=(mOut.shape[0], chunks, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True)
