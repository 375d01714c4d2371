"""SwiGLU backward of the MoE layer fused with the 1x128 quantization of its result (CuTe DSL).

Per packed row ``r`` with combine weight ``w``, from the saved FP8 ``h = [gate | up]`` (1x128
scales) and ``da`` (FP32, the dgrad GEMM's output), the steps torch's autograd runs on the GPU
for ``s = silu(gate) · up``, each rounded where torch rounds:

    g, u    = code · scale                        (dequantize, FP32)
    e       = expf(-g);  silu = g / (1 + e);  sig = 1 / (1 + e)
    go      = da · w
    d_up    = go · silu
    d_gate  = ((go · u) · sig) · fma(g, 1 - sig, 1)   (torch's silu_backward, contracted by nvcc)
    a       = (silu · u) · w                       (the dW2 GEMM's operand)
    dw_part = Σ over the 128 columns of the block of da · (silu · u)

Outputs: ``dh = [d_gate | d_up]`` in FP32 (the dW1 GEMM quantizes it along tokens), with
``with_q`` (F a multiple of 128, so the blocks of gate and up are blocks of dh) also quantized
1x128 along features (the dX GEMM's operand), ``a`` in FP32, and one partial ``∂y/∂w`` sum per
row and 128-column block of gate (the host adds a row's partials). ``h`` and ``da`` are read
once. Each 16-lane group owns one 1x128 block of gate and the matching columns of up, the CTA
mapping of ``quant_1x128`` (F a multiple of 16: 8 columns of up never straddle a scale block).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ...cute.fp8_block import (
    GROUPS_PER_CTA,
    LANES,
    ROWS_PER_CTA,
    THREADS,
    UNROLL,
    VEC,
    as_fp8,
    grid_1x128,
    quantize_block,
)
from ...cute.pdl import after_previous_grid


@cute.jit
def _load_f32(mT: cute.Tensor, row, col, in_bounds):
    frag = cute.make_rmem_tensor((1, VEC), mT.element_type)
    frag.fill(0)
    if in_bounds:
        cute.autovec_copy(cute.local_tile(mT, (1, VEC), (row, col // VEC)), frag)
    return frag.load().to(Float32)


@cute.jit
def _store_f32(mT: cute.Tensor, values, row, col):
    frag = cute.make_rmem_tensor((1, VEC), Float32)
    frag.store(values)
    cute.autovec_copy(frag, cute.local_tile(mT, (1, VEC), (row, col // VEC)))


@cute.kernel
def _swiglu_backward_kernel(mHQ_u8: cute.Tensor, mHS: cute.Tensor, mDA: cute.Tensor, mW: cute.Tensor,
                            mDHQ_u8: cute.Tensor, mDHS: cute.Tensor, mDH: cute.Tensor, mA: cute.Tensor,
                            mDW: cute.Tensor, with_q: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    after_previous_grid()
    bidx, _, _ = cute.arch.block_idx()
    rows = mDA.shape[0]
    ffn = mDA.shape[1]
    blocks_per_row = mDW.shape[1]
    mHQ = as_fp8(mHQ_u8)
    mDHQ = as_fp8(mDHQ_u8)

    lane = tidx % LANES
    row_tile = bidx // blocks_per_row
    kb = bidx - row_tile * blocks_per_row
    col = kb * 128 + lane * VEC
    for u in cutlass.range_constexpr(UNROLL):
        row = row_tile * ROWS_PER_CTA + u * GROUPS_PER_CTA + tidx // LANES
        in_bounds = row < rows and col < ffn
        g_code = _load_f32(mHQ, row, col, in_bounds)
        u_code = _load_f32(mHQ, row, ffn + col, in_bounds)
        da = _load_f32(mDA, row, col, in_bounds)
        w = Float32(0.0)
        g_scale = Float32(0.0)
        u_scale = Float32(0.0)
        if in_bounds:
            w = mW[row]
            g_scale = mHS[row, kb]
            u_scale = mHS[row, (ffn + col) // 128]
        d_gate = cute.make_rmem_tensor((1, VEC), Float32)
        d_up = cute.make_rmem_tensor((1, VEC), Float32)
        act = cute.make_rmem_tensor((1, VEC), Float32)
        dw_part = Float32(0.0)
        for i in cutlass.range_constexpr(VEC):
            g = g_code[i] * g_scale
            up = u_code[i] * u_scale
            e = cute.math.exp(-g)
            silu = g / (Float32(1.0) + e)
            sig = Float32(1.0) / (Float32(1.0) + e)
            go = da[i] * w
            d_up[0, i] = go * silu
            d_gate[0, i] = ((go * up) * sig) * cute.math.fma(g, Float32(1.0) - sig, Float32(1.0))
            s = silu * up
            act[0, i] = s * w
            dw_part = dw_part + da[i] * s
        # the 16 lanes of the block: every lane joins the shuffles, in bounds or not
        dw_part = cute.arch.warp_reduction_sum(dw_part, threads_in_group=LANES)
        if in_bounds:
            _store_f32(mDH, d_gate.load(), row, col)
            _store_f32(mDH, d_up.load(), row, ffn + col)
            _store_f32(mA, act.load(), row, col)
            if lane == 0:
                mDW[row, kb] = dw_part
        if cutlass.const_expr(with_q):
            quantize_block(mDHQ, mDHS, d_gate.load(), row, kb, col, lane, in_bounds)
            quantize_block(mDHQ, mDHS, d_up.load(), row, blocks_per_row + kb, ffn + col, lane, in_bounds)


@cute.jit
def swiglu_backward_1x128(mHQ_u8: cute.Tensor, mHS: cute.Tensor, mDA: cute.Tensor, mW: cute.Tensor,
                          mDHQ_u8: cute.Tensor, mDHS: cute.Tensor, mDH: cute.Tensor, mA: cute.Tensor,
                          mDW: cute.Tensor, stream):
    grid = grid_1x128(mDA.shape[0], mDW.shape[1])
    _swiglu_backward_kernel(mHQ_u8, mHS, mDA, mW, mDHQ_u8, mDHS, mDH, mA, mDW, True).launch(
        grid=(grid, 1, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True)


@cute.jit
def swiglu_backward(mHQ_u8: cute.Tensor, mHS: cute.Tensor, mDA: cute.Tensor, mW: cute.Tensor, mDH: cute.Tensor,
                    mA: cute.Tensor, mDW: cute.Tensor, stream):
    grid = grid_1x128(mDA.shape[0], mDW.shape[1])
    _swiglu_backward_kernel(mHQ_u8, mHS, mDA, mW, mHQ_u8, mHS, mDH, mA, mDW, False).launch(
        grid=(grid, 1, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True)
