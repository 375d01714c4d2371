"""Host side of the FP8 quantize kernels: validation, compile cache, launch."""

from __future__ import annotations

import torch

from ...runtime import kernel_cache, sm_count
from ..layouts import empty_mn_major_tma_aligned

__all__ = ["kernel_unsupported", "quantize_1x128", "quantize_rowwise", "quantize_128x128", "quantize_128x128_t",
           "quantize_dual", "quantize_t_gathered",
           "pack_1x128", "swiglu_1x128", "swiglu_backward_1x128",
           "unpack_rows", "build_kernel", "build_unpack_kernel", "compile_kernel",
           "KERNELS", "UNPACK_DTYPES"]

ARCH = "sm_90a"
KERNELS = ("1x128", "128x128", "128x128_t", "dual", "rowwise", "rowwise_staged", "pack_1x128", "pack_tokens_1x128",
           "swiglu_1x128", "swiglu_h_1x128", "swiglu_backward_1x128", "swiglu_backward", "t_gathered")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
UNPACK_DTYPES = _DTYPES  # rows and output dtypes of the unpack kernel


def kernel_unsupported(x: torch.Tensor) -> str | None:
    """Why the kernels cannot take ``x`` (None: they can)."""
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype}"
    if x.dim() != 2:
        return f"{x.dim()}-D input (the kernels take [rows, cols])"
    if x.shape[1] % 16 or x.stride(1) != 1 or x.stride(0) % 16 or x.data_ptr() % 16:
        return "cols must be a multiple of 16, rows contiguous and 16-byte aligned"
    return None


def _cutlass_dtype(dtype: torch.dtype):
    import cutlass

    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32}[dtype]


def build_kernel(kind: str, dtype: torch.dtype, arch: str = ARCH):
    """Compile one quantize kernel for ``dtype`` inputs on fake tensors (no GPU needed), uncached."""
    if kind not in KERNELS:
        raise ValueError(f"kind: expected one of {KERNELS}, got {kind!r}")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from ...runtime import compile_for_arch
    from . import fp8_quant, swiglu_backward

    def data(dt):
        return make_fake_tensor(dt, (cute.sym_int(), cute.sym_int(divisibility=16)),
                                stride=(cute.sym_int64(divisibility=16), 1), assumed_align=16)

    def scale():
        return make_fake_tensor(cutlass.Float32, (cute.sym_int(), cute.sym_int()),
                                stride=(cute.sym_int64(), cute.sym_int64()), assumed_align=4)

    x, q = data(_cutlass_dtype(dtype)), data(cutlass.Uint8)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    fn = {"1x128": fp8_quant.quant_1x128, "128x128": fp8_quant.quant_128x128,
          "128x128_t": fp8_quant.quant_128x128_t, "dual": fp8_quant.quant_dual,
          "rowwise": fp8_quant.quant_rowwise, "rowwise_staged": fp8_quant.quant_rowwise_staged,
          "pack_1x128": fp8_quant.pack_1x128,
          "pack_tokens_1x128": fp8_quant.pack_tokens_1x128,
          "swiglu_1x128": fp8_quant.swiglu_1x128, "swiglu_h_1x128": fp8_quant.swiglu_h_1x128,
          "swiglu_backward_1x128": swiglu_backward.swiglu_backward_1x128,
          "swiglu_backward": swiglu_backward.swiglu_backward, "t_gathered": fp8_quant.quant_t_gathered}[kind]
    if kind.startswith("swiglu_backward"):  # dtype: da's (h is FP8; dh and a are FP32)
        row_weights = make_fake_tensor(cutlass.Float32, (cute.sym_int(),), stride=(1,), assumed_align=4)
        dh_q = (data(cutlass.Uint8), scale()) if kind == "swiglu_backward_1x128" else ()
        args = (q, scale(), x, row_weights, *dh_q, data(cutlass.Float32), data(cutlass.Float32), scale())
    elif kind == "dual":
        args = (x, q, scale(), data(cutlass.Uint8), scale(), cutlass.Int32(1))
    elif kind == "t_gathered":
        src = make_fake_tensor(cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
        args = (x, src, q, scale())
    elif kind == "128x128_t":
        args = (x, q, scale(), data(cutlass.Uint8))
    elif kind.startswith("pack"):
        slot_rows = make_fake_tensor(cutlass.Int64, (cute.sym_int(), cute.sym_int()), stride=(cute.sym_int64(), 1),
                                     assumed_align=8)
        row_slots = make_fake_tensor(cutlass.Int64, (cute.sym_int(),), stride=(1,), assumed_align=8)
        args = (x, slot_rows, row_slots, q, scale()) + ((data(cutlass.Uint8), scale()) if kind == "pack_tokens_1x128"
                                                          else ())
    elif kind.startswith("swiglu"):
        row_weights = make_fake_tensor(cutlass.Float32, (cute.sym_int(),), stride=(1,), assumed_align=4)
        args = (x, row_weights, q, scale()) + ((data(cutlass.Uint8), scale()) if kind == "swiglu_h_1x128" else ())
    elif kind == "1x128":
        args = (x, q, scale(), cutlass.Int32(1))
    else:
        args = (x, q, scale())
    return compile_for_arch(fn, *args, stream, arch=arch, tvm_ffi=True)


def compile_kernel(kind: str, dtype: torch.dtype, arch: str = ARCH):
    """The launchable kernel, compiled once per (kind, dtype, arch) through the kernel cache."""
    return kernel_cache.get(f"quant_fp8_{kind}", {"dtype": dtype}, arch,
                            lambda: build_kernel(kind, dtype, arch))


def _resident_ctas(device: torch.device, per_sm: int) -> int:
    """Grid of a persistent streaming kernel: the CTAs that fit on the device at once."""
    return sm_count(device) * per_sm


# Resident CTAs per SM of the persistent streaming kernels (fp8_quant; 256-thread CTAs): 1x128
# holds 32 KB (bf16/fp16) or 64 KB (fp32) of slots at 32-34 registers; dual: see
# ``fp8_quant.dual_ctas_per_sm``.
def _ctas_per_sm(kind: str, dtype: torch.dtype) -> int:
    if kind == "1x128":
        return 6 if dtype.itemsize <= 2 else 3
    if kind == "dual":
        from .fp8_quant import dual_ctas_per_sm

        return dual_ctas_per_sm(8 * dtype.itemsize)
    return 2


def quantize_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (FP8 [M, K], FP32 scales [M, ceil(K/128)] stored MN-major, TMA-aligned)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = empty_mn_major_tma_aligned(m, -(-k // 128), x.device)
    if m:
        with torch.cuda.device(x.device):
            compile_kernel("1x128", x.dtype)(x, q.view(torch.uint8), s,
                                             _resident_ctas(x.device, _ctas_per_sm("1x128", x.dtype)))
    return q, s


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (FP8 [M, K], FP32 scales [M, 1])."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        with torch.cuda.device(x.device):
            from .fp8_quant import ROWWISE_SHORT_COLS  # longer rows are staged in shared memory

            kind = "rowwise" if k <= ROWWISE_SHORT_COLS else "rowwise_staged"
            compile_kernel(kind, x.dtype)(x, q.view(torch.uint8), s)
    return q, s


def quantize_128x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [N, K] -> (FP8 [N, K], FP32 scales [ceil(N/128), ceil(K/128)] row-major)."""
    n, k = x.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(-(-n // 128), -(-k // 128), dtype=torch.float32, device=x.device)
    if n:
        with torch.cuda.device(x.device):
            compile_kernel("128x128", x.dtype)(x, q.view(torch.uint8), s)
    return q, s


def quantize_by_recipe(x: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] in ``fp8_block1x128``, ``fp8_rowwise`` or ``fp8_block128x128``: (codes, scales)."""
    kernel = {"fp8_block1x128": quantize_1x128, "fp8_rowwise": quantize_rowwise,
              "fp8_block128x128": quantize_128x128}[recipe]
    return kernel(x)


def quantize_128x128_t(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` [R, K], a stack of R / n matrices of ``n`` rows -> (FP8 [R, K], FP32 scales
    [ceil(R/128), ceil(K/128)] row-major, FP8 [R / n · K, n]: each matrix's transposed codes).
    Needs n % 16 == 0, R % n == 0, and n % 128 == 0 when R > n (no block spans two matrices)."""
    r, k = x.shape
    if n % 16 or r % n or (r > n and n % 128):
        raise ValueError(f"n: expected a multiple of 16 dividing {r} (and of 128 when {r} > n), got {n}")
    q = torch.empty(r, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(-(-r // 128), -(-k // 128), dtype=torch.float32, device=x.device)
    qt = torch.empty(r // n * k, n, dtype=torch.float8_e4m3fn, device=x.device)
    if r:
        with torch.cuda.device(x.device):
            compile_kernel("128x128_t", x.dtype)(x, q.view(torch.uint8), s, qt.view(torch.uint8))
    return q, s, qt


def quantize_dual(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` [T, K] -> 1x128 along K: (FP8 [T, K], scales [T, ceil(K/128)] MN-major), and 1x128
    along T of ``xᵀ`` zero-padded to ``T_pad = round_up(T, 16)``: (FP8 [K, T_pad], scales
    [K, ceil(T/128)] MN-major)."""
    t, k = x.shape
    t_pad = -(-t // 16) * 16
    q = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = empty_mn_major_tma_aligned(t, -(-k // 128), x.device)
    qt = torch.empty(k, t_pad, dtype=torch.float8_e4m3fn, device=x.device)
    st = empty_mn_major_tma_aligned(k, -(-t_pad // 128), x.device)
    if t:  # rows past T load as zeros, so the kernel writes the padding columns too
        with torch.cuda.device(x.device):
            compile_kernel("dual", x.dtype)(x, q.view(torch.uint8), s, qt.view(torch.uint8), st,
                                            _resident_ctas(x.device, _ctas_per_sm("dual", x.dtype)))
    return q, s, qt, st


def quantize_t_gathered(x: torch.Tensor, src_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 along tokens of gathered rows: with ``g[i] = x[src_rows[i]]`` (zeros where
    ``src_rows[i] < 0``), ``g`` [W, C] -> the token-major half of ``quantize_dual(g)``: (FP8
    ``gᵀ`` [C, W], scales [C, W/128] MN-major), bit for bit, without materializing ``g``.
    ``src_rows``: int32 [W] contiguous, W a multiple of 16, entries < x.shape[0]."""
    w = src_rows.shape[0]
    c = x.shape[1]
    qt = torch.empty(c, w, dtype=torch.float8_e4m3fn, device=x.device)
    st = empty_mn_major_tma_aligned(c, -(-w // 128), x.device)
    if w and c:
        with torch.cuda.device(x.device):
            compile_kernel("t_gathered", x.dtype)(x, src_rows, qt.view(torch.uint8), st)
    return qt, st


def pack_1x128(x: torch.Tensor, slot_rows: torch.Tensor, row_slots: torch.Tensor, with_tokens: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """MoE packing fused with 1x128 quantization: ``x`` [T, H] -> (FP8 [T·k, H], FP32 scales
    [T·k, ceil(H/128)] MN-major), then with ``with_tokens`` ``quantize_1x128(x)`` (FP8 [T, H],
    scales MN-major) from the same pass, else None, None. Packed row ``slot_rows[t, j]`` holds
    token ``t`` (nothing where -1); row ``p`` with ``row_slots[p] == -1`` is zero with scale 1.
    Both index maps int64, contiguous (:class:`lowprec.moe.Routing`'s)."""
    t, h = x.shape
    n = row_slots.shape[0]
    q = torch.empty(n, h, dtype=torch.float8_e4m3fn, device=x.device)
    s = empty_mn_major_tma_aligned(n, -(-h // 128), x.device)
    xq = xs = None
    if with_tokens:
        xq = torch.empty(t, h, dtype=torch.float8_e4m3fn, device=x.device)
        xs = empty_mn_major_tma_aligned(t, -(-h // 128), x.device)
    if t and h:
        with torch.cuda.device(x.device):
            if with_tokens:
                compile_kernel("pack_tokens_1x128", x.dtype)(x, slot_rows, row_slots, q.view(torch.uint8), s,
                                                              xq.view(torch.uint8), xs)
            else:
                compile_kernel("pack_1x128", x.dtype)(x, slot_rows, row_slots, q.view(torch.uint8), s)
    return q, s, xq, xs


def swiglu_1x128(h: torch.Tensor, row_weights: torch.Tensor, with_h: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``h = [gate | up]`` [R, 2F] -> ``A = silu(gate) · up · row_weights[:, None]`` (FP32, as torch
    on the GPU) quantized 1x128: (FP8 [R, F], FP32 scales [R, ceil(F/128)] MN-major), and with
    ``with_h`` (F a multiple of 128) also ``h`` quantized 1x128 (FP8 [R, 2F], scales MN-major),
    else None, None. ``row_weights``: FP32 [R], contiguous."""
    r, two_f = h.shape
    f = two_f // 2
    q = torch.empty(r, f, dtype=torch.float8_e4m3fn, device=h.device)
    s = empty_mn_major_tma_aligned(r, -(-f // 128), h.device)
    hq = hs = None
    if with_h:
        hq = torch.empty(r, two_f, dtype=torch.float8_e4m3fn, device=h.device)
        hs = empty_mn_major_tma_aligned(r, two_f // 128, h.device)
    if r and f:
        with torch.cuda.device(h.device):
            if with_h:
                compile_kernel("swiglu_h_1x128", h.dtype)(h, row_weights, q.view(torch.uint8), s, hq.view(torch.uint8),
                                                           hs)
            else:
                compile_kernel("swiglu_1x128", h.dtype)(h, row_weights, q.view(torch.uint8), s)
    return q, s, hq, hs


def swiglu_backward_1x128(hq: torch.Tensor, hs: torch.Tensor, da: torch.Tensor, row_weights: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor,
                                     torch.Tensor]:
    """SwiGLU backward (see :mod:`.swiglu_backward`) from the saved ``h = [gate | up]`` (FP8
    ``hq`` [R, 2F] contiguous, 1x128 scales ``hs`` [R, ceil(2F/128)], any strides), ``da``
    [R, F] FP32 and ``row_weights`` FP32 [R], F a multiple of 16.

    Returns ``(dh FP32 [R, 2F], dh codes FP8 [R, 2F], dh scales [R, 2F/128] MN-major, a =
    silu(gate)·up·w FP32 [R, F], ∂y/∂w FP32 [R])``; the codes and scales are None unless F is a
    multiple of 128 (then dh's 1x128 blocks straddle gate and up: quantize ``dh`` instead)."""
    r, f = da.shape
    dev = da.device
    with_q = f % 128 == 0
    dh = torch.empty(r, 2 * f, dtype=torch.float32, device=dev)
    a = torch.empty(r, f, dtype=torch.float32, device=dev)
    dw_parts = torch.empty(r, -(-f // 128), dtype=torch.float32, device=dev)
    dhq = dhs = None
    if with_q:
        dhq = torch.empty(r, 2 * f, dtype=torch.float8_e4m3fn, device=dev)
        dhs = empty_mn_major_tma_aligned(r, 2 * f // 128, dev)
    if r and f:
        with torch.cuda.device(dev):
            if with_q:
                compile_kernel("swiglu_backward_1x128", da.dtype)(hq.view(torch.uint8), hs, da, row_weights,
                                                                   dhq.view(torch.uint8), dhs, dh, a, dw_parts)
            else:
                compile_kernel("swiglu_backward", da.dtype)(hq.view(torch.uint8), hs, da, row_weights, dh, a,
                                                             dw_parts)
    return dh, dhq, dhs, a, dw_parts.sum(dim=1)


def build_unpack_kernel(dtype: torch.dtype, out_dtype: torch.dtype, top_k: int, arch: str = ARCH):
    """Compile the MoE unpack kernel for ``dtype`` rows, ``out_dtype`` output and ``top_k`` slots
    per token (a static dimension: the slot loop unrolls) on fake tensors, uncached."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from ...runtime import compile_for_arch
    from . import unpack

    def data(dt):
        return make_fake_tensor(dt, (cute.sym_int(), cute.sym_int(divisibility=16)),
                                stride=(cute.sym_int64(divisibility=16), 1), assumed_align=16)

    tokens = cute.sym_int()
    slot_rows = make_fake_tensor(cutlass.Int64, (tokens, top_k), stride=(top_k, 1), assumed_align=8)
    weights = make_fake_tensor(cutlass.Float32, (tokens, top_k), stride=(top_k, 1), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return compile_for_arch(unpack.unpack_rows, data(_cutlass_dtype(dtype)), slot_rows, weights,
                            data(_cutlass_dtype(out_dtype)), stream, arch=arch, tvm_ffi=True)


def unpack_rows(rows: torch.Tensor, slot_rows: torch.Tensor, weights: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """MoE combine: ``rows`` [T·k, H] -> ``out`` [T, H] in ``out_dtype``, ``out[t] = Σ_j weights[t, j] ·
    rows[slot_rows[t, j]]`` over ``slot_rows[t, j] >= 0`` (FP32, slot order, product rounded before
    the add). ``slot_rows`` int64 and ``weights`` FP32, both [T, k] contiguous."""
    tokens, top_k = slot_rows.shape
    out = torch.empty(tokens, rows.shape[1], dtype=out_dtype, device=rows.device)
    if tokens and rows.shape[1]:
        kernel = kernel_cache.get("moe_unpack", {"dtype": rows.dtype, "out_dtype": out_dtype, "top_k": top_k}, ARCH,
                                  lambda: build_unpack_kernel(rows.dtype, out_dtype, top_k))
        with torch.cuda.device(rows.device):
            kernel(rows, slot_rows, weights, out)
    return out
