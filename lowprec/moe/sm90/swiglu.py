"""The MoE layer's SwiGLU (CuTe DSL): fused with 1x128 FP8 quantization (training, FP8 experts), or
in the rows' own dtype (NVFP4 experts, whose second GEMM takes bf16 rows)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ...cute.fp8_block import (
    LANES,
    THREADS,
    as_fp8,
    grid_1x128,
    load_block_columns,
    quantize_block,
)
from ...cute.pdl import after_previous_grid

# SwiGLU: ~50 instructions per element (expf, IEEE division) on top of two loads. With UNROLL
# blocks a thread held 98 registers (2 CTAs per SM, load then compute then store): 44-47% of copy
# bandwidth; one block per thread: 44 registers, 5 CTAs per SM overlapping each other, 74-77%.
SWIGLU_UNROLL = 1


# SwiGLU fused with 1x128 quantization (the MoE layer's activation). h = [gate | up] is [R, 2F]
# (the first expert GEMM's output); A = silu(gate) · up · w[row] in FP32, each step rounded as
# torch computes it on the GPU: silu(g) = g / (1 + expf(-g)) (libdevice expf, IEEE division), then
# the two products. Each 16-lane group reads a 1x128 block of gate and the matching block of up,
# like quant_1x128. With ``with_h`` (F a multiple of 128, so those are blocks of h) it also
# quantizes h itself, the copy the layer keeps for the backward pass: h is read once.
@cute.kernel
def _swiglu_1x128_kernel(mH: cute.Tensor, mW: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor,
                         mHQ_u8: cute.Tensor, mHS: cute.Tensor, with_h: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    after_previous_grid()
    bidx, _, _ = cute.arch.block_idx()
    rows = mH.shape[0]
    ffn = mQ_u8.shape[1]
    blocks_per_row = mS.shape[1]
    mQ = as_fp8(mQ_u8)
    mHQ = as_fp8(mHQ_u8)

    lane = tidx % LANES
    values, coords = load_block_columns(mH, bidx, tidx, blocks_per_row, ffn, (0, ffn), SWIGLU_UNROLL)
    for u in cutlass.range_constexpr(SWIGLU_UNROLL):
        row, kb, col = coords[u]
        gate, up = values[u]
        in_bounds = row < rows and col < ffn
        if cutlass.const_expr(with_h):
            quantize_block(mHQ, mHS, gate, row, kb, col, lane, in_bounds)
            quantize_block(mHQ, mHS, up, row, blocks_per_row + kb, ffn + col, lane, in_bounds)
        w = Float32(0.0)
        if row < rows:
            w = mW[row]
        silu = gate / (Float32(1.0) + cute.math.exp(-gate))
        quantize_block(mQ, mS, silu * up * w, row, kb, col, lane, in_bounds)


@cute.jit
def _launch_swiglu(mH: cute.Tensor, mW: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor, mHQ_u8: cute.Tensor,
                   mHS: cute.Tensor, with_h: cutlass.Constexpr, stream):
    grid = grid_1x128(mH.shape[0], mS.shape[1], SWIGLU_UNROLL)
    _swiglu_1x128_kernel(mH, mW, mQ_u8, mS, mHQ_u8, mHS, with_h).launch(
        grid=(grid, 1, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True)


@cute.jit
def swiglu_1x128(mH: cute.Tensor, mW: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor, stream):
    _launch_swiglu(mH, mW, mQ_u8, mS, mQ_u8, mS, False, stream)


@cute.jit
def swiglu_h_1x128(mH: cute.Tensor, mW: cute.Tensor, mQ_u8: cute.Tensor, mS: cute.Tensor, mHQ_u8: cute.Tensor,
                   mHS: cute.Tensor, stream):
    _launch_swiglu(mH, mW, mQ_u8, mS, mHQ_u8, mHS, True, stream)


ROWS_VEC = 8  # columns per thread of the unquantized form: one 16-byte load of bf16 gate and of up
ROWS_THREADS = 128


# SwiGLU in the rows' dtype: a = silu(gate) · up in FP32, each step as torch computes it on the GPU
# (h.float(), silu, the product), rounded once to h's dtype. Grid: one CTA row per packed row,
# 128 threads per 1024 columns; each thread reads 8 gate and 8 up values (F a multiple of 16).
@cute.kernel
def _swiglu_rows_kernel(mH: cute.Tensor, mA: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    after_previous_grid()
    row, chunk, _ = cute.arch.block_idx()
    ffn = mA.shape[1]
    col = (chunk * ROWS_THREADS + tidx) * ROWS_VEC
    if col < ffn:
        gate = cute.make_rmem_tensor((1, ROWS_VEC), mH.element_type)
        up = cute.make_rmem_tensor((1, ROWS_VEC), mH.element_type)
        cute.autovec_copy(cute.local_tile(mH, (1, ROWS_VEC), (row, col // ROWS_VEC)), gate)
        cute.autovec_copy(cute.local_tile(mH, (1, ROWS_VEC), (row, (ffn + col) // ROWS_VEC)), up)
        g = gate.load().to(Float32)
        u = up.load().to(Float32)
        out = cute.make_rmem_tensor((1, ROWS_VEC), mA.element_type)
        out.store((g / (Float32(1.0) + cute.math.exp(-g)) * u).to(mA.element_type))
        cute.autovec_copy(out, cute.local_tile(mA, (1, ROWS_VEC), (row, col // ROWS_VEC)))


@cute.jit
def swiglu_rows(mH: cute.Tensor, mA: cute.Tensor, stream):
    chunks = (mA.shape[1] // ROWS_VEC + ROWS_THREADS - 1) // ROWS_THREADS
    _swiglu_rows_kernel(mH, mA).launch(grid=(mA.shape[0], chunks, 1), block=(ROWS_THREADS, 1, 1), stream=stream,
                                       use_pdl=True)
