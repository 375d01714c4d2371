"""Host side of the FP8 quantize kernels: validation, compile cache, launch."""

from __future__ import annotations

import functools

import torch

from ...runtime import ffi_entry, kernel_cache, on_device, sm_count
from ..layouts import empty_dual_outputs, empty_mn_major_tma_aligned
from ..ops import DUAL_T_RECIPES

__all__ = ["quantize_1x128", "quantize_rowwise", "quantize_128x128", "quantize_128x128_t", "quantize_dual",
           "swiglu_quantize_dual", "swiglu_quantize_dual_t16x128", "swiglu_quantize_dual_t128x128",
           "swiglu_dgate_quantize_dual",
           "swiglu_dup_quantize_dual",
           "quantize_t_gathered", "quantize_codes", "quantize_dual_codes", "quantize_with_transpose_codes",
           "quantize_t_gathered_codes", "build_kernel", "compile_kernel", "KERNELS", "fake_rows", "fake_scales",
           "cutlass_dtype"]

ARCH = "sm_90a"
KERNELS = ("1x128", "128x128", "128x128_t", "dual", "rowwise", "rowwise_staged", "t_gathered", "swiglu_dual",
           "swiglu_dgate_dual", "swiglu_dup_dual")
# inputs of each kernel of the dual family (the SwiGLU ones: gate, up and / or da, one shape)
_DUAL_INPUTS = {"dual": 1, "swiglu_dual": 2, "swiglu_dgate_dual": 3, "swiglu_dup_dual": 2}
# the dual kernels that can quantize their transposed half in 16x128 or 128x128 blocks (activations,
# which are the weight gradient's B operand; gradients stay 1x128)
T_BLOCK_KERNELS = ("dual", "swiglu_dual")
T_ROWS = tuple(DUAL_T_RECIPES)  # rows of the transposed half's scale blocks (x's columns) the kernels take


def cutlass_dtype(dtype: torch.dtype):
    import cutlass

    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32}[dtype]


def fake_rows(dtype):
    """A fake [rows, cols] tensor as the kernels take it: cols a multiple of 16, rows 16-byte aligned."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(dtype, (cute.sym_int(), cute.sym_int(divisibility=16)),
                            stride=(cute.sym_int64(divisibility=16), 1), assumed_align=16)


def fake_scales():
    """A fake FP32 scale grid of any strides."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(cutlass.Float32, (cute.sym_int(), cute.sym_int()),
                            stride=(cute.sym_int64(), cute.sym_int64()), assumed_align=4)


def build_kernel(kind: str, dtype: torch.dtype, arch: str = ARCH, t_rows: int = 1):
    """Compile one quantize kernel for ``dtype`` inputs on fake tensors (no GPU needed), uncached.
    ``t_rows`` (``dual``, ``swiglu_dual``): the transposed half in 16x128 (16) or 128x128 (128)
    blocks instead of 1x128 (1)."""
    if kind not in KERNELS:
        raise ValueError(f"kind: expected one of {KERNELS}, got {kind!r}")
    if t_rows not in T_ROWS:
        raise ValueError(f"t_rows: expected one of {T_ROWS}, got {t_rows!r}")
    if t_rows != 1 and kind not in T_BLOCK_KERNELS:
        raise ValueError(f"t_rows: only the {T_BLOCK_KERNELS} kernels quantize their transposed half in "
                         f"{t_rows}x128 blocks, got kind {kind!r}")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from ...runtime import compile_for_arch
    from . import fp8_quant

    x, q = fake_rows(cutlass_dtype(dtype)), fake_rows(cutlass.Uint8)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    fn = {"1x128": fp8_quant.quant_1x128, "128x128": fp8_quant.quant_128x128,
          "128x128_t": fp8_quant.quant_128x128_t, "dual": fp8_quant.quant_dual,
          "rowwise": fp8_quant.quant_rowwise, "rowwise_staged": fp8_quant.quant_rowwise_staged,
          "t_gathered": fp8_quant.quant_t_gathered, "swiglu_dual": fp8_quant.swiglu_dual,
          "swiglu_dgate_dual": fp8_quant.swiglu_dgate_dual, "swiglu_dup_dual": fp8_quant.swiglu_dup_dual}[kind]
    if kind in _DUAL_INPUTS:
        inputs = [x] + [fake_rows(cutlass_dtype(dtype)) for _ in range(_DUAL_INPUTS[kind] - 1)]
        args = (*inputs, q, fake_scales(), fake_rows(cutlass.Uint8), fake_scales(), cutlass.Int32(1))
    elif kind == "t_gathered":
        src = make_fake_tensor(cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
        args = (x, src, q, fake_scales())
    elif kind == "128x128_t":
        args = (x, q, fake_scales(), fake_rows(cutlass.Uint8))
    elif kind == "1x128":
        args = (x, q, fake_scales(), cutlass.Int32(1))
    else:
        args = (x, q, fake_scales())
    extra = {"t_rows": t_rows} if t_rows != 1 else {}
    return compile_for_arch(fn, *args, stream, arch=arch, tvm_ffi=True, **extra)


@functools.cache  # in front of the kernel cache: one hash of plain values per launch
def compile_kernel(kind: str, dtype: torch.dtype, arch: str = ARCH, t_rows: int = 1):
    """The launchable kernel, compiled once per (kind, dtype, arch, t_rows) through the kernel cache."""
    name = f"quant_fp8_{kind}_t{t_rows}x128" if t_rows != 1 else f"quant_fp8_{kind}"
    return ffi_entry(kernel_cache.get(name, {"dtype": dtype}, arch,
                                      lambda: build_kernel(kind, dtype, arch, t_rows)))


def _resident_ctas(device: torch.device, per_sm: int) -> int:
    """Grid of a persistent streaming kernel: the CTAs that fit on the device at once."""
    return sm_count(device) * per_sm


# Resident CTAs per SM of the persistent streaming kernels (fp8_quant; 256-thread CTAs): 1x128
# holds 32 KB (bf16/fp16) or 64 KB (fp32) of slots at 32-34 registers; dual: see
# ``fp8_quant.dual_ctas_per_sm``.
def _ctas_per_sm(kind: str, dtype: torch.dtype) -> int:
    if kind == "1x128":
        return 6 if dtype.itemsize <= 2 else 3
    if kind in _DUAL_INPUTS:
        from .fp8_quant import dual_ctas_per_sm

        return dual_ctas_per_sm(8 * dtype.itemsize, _DUAL_INPUTS[kind])
    return 2


def quantize_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (FP8 [M, K], FP32 scales [M, ceil(K/128)] stored MN-major, TMA-aligned)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = empty_mn_major_tma_aligned(m, -(-k // 128), x.device)
    if m:
        with on_device(x.device):
            compile_kernel("1x128", x.dtype)(x, q.view(torch.uint8), s,
                                             _resident_ctas(x.device, _ctas_per_sm("1x128", x.dtype)))
    return q, s


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (FP8 [M, K], FP32 scales [M, 1])."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        with on_device(x.device):
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
        with on_device(x.device):
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
    if n <= 0 or n % 16 or r % n or (r > n and n % 128):
        raise ValueError(f"n: expected a positive multiple of 16 dividing {r} (and of 128 when {r} > n), got {n}")
    q = torch.empty(r, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(-(-r // 128), -(-k // 128), dtype=torch.float32, device=x.device)
    qt = torch.empty(r // n * k, n, dtype=torch.float8_e4m3fn, device=x.device)
    if r:
        with on_device(x.device):
            compile_kernel("128x128_t", x.dtype)(x, q.view(torch.uint8), s, qt.view(torch.uint8))
    return q, s, qt


def quantize_dual(x: torch.Tensor, t_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                               torch.Tensor]:
    """``x`` [T, K] -> 1x128 along K: (FP8 [T, K], scales [T, ceil(K/128)] MN-major), and 1x128
    along T of ``xᵀ`` zero-padded to ``T_pad = round_up(T, 16)``: (FP8 [K, T_pad], scales
    [K, ceil(T/128)] MN-major), or with ``t_rows`` 16 / 128 blocks of 16x128 / 128x128 of ``xᵀ``
    (scales [ceil(K/16), ceil(T/128)] MN-major / [ceil(K/128), ceil(T/128)] row-major)."""
    return _dual("dual", x, t_rows=t_rows)


def _dual(kind: str, *inputs: torch.Tensor, t_rows: int = 1
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A kernel of the dual family on ``inputs`` (one shape [T, K], rows 16-byte aligned)."""
    x = inputs[0]
    q, s, qt, st = empty_dual_outputs(*x.shape, x.device, t_rows)
    if x.shape[0]:  # rows past T load as zeros, so the kernel writes the padding columns too
        with on_device(x.device):
            compile_kernel(kind, x.dtype, ARCH, t_rows)(*inputs, q.view(torch.uint8), s, qt.view(torch.uint8), st,
                                                       _resident_ctas(x.device, _ctas_per_sm(kind, x.dtype)))
    return q, s, qt, st


def swiglu_quantize_dual(gate: torch.Tensor, up: torch.Tensor, t_rows: int = 1
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_dual(silu(gate) · up, t_rows)`` in FP32 from ``gate``, ``up`` [T, F] (one
    dtype), one pass."""
    return _dual("swiglu_dual", gate, up, t_rows=t_rows)


def swiglu_quantize_dual_t16x128(gate: torch.Tensor, up: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`swiglu_quantize_dual` with the transposed half in 16x128 blocks."""
    return swiglu_quantize_dual(gate, up, t_rows=16)


def swiglu_quantize_dual_t128x128(gate: torch.Tensor, up: torch.Tensor
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`swiglu_quantize_dual` with the transposed half in 128x128 blocks."""
    return swiglu_quantize_dual(gate, up, t_rows=128)


def swiglu_dgate_quantize_dual(gate: torch.Tensor, up: torch.Tensor, da: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_dual(silu_backward(da · up, gate))`` (the gate's gradient), one pass."""
    return _dual("swiglu_dgate_dual", gate, up, da)


def swiglu_dup_quantize_dual(gate: torch.Tensor, da: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_dual(da · silu(gate))`` (the up projection's gradient), one pass."""
    return _dual("swiglu_dup_dual", gate, da)


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
        with on_device(x.device):
            compile_kernel("t_gathered", x.dtype)(x, src_rows, qt.view(torch.uint8), st)
    return qt, st


# ----------------------------------------------------------------------------- registered kernels
# The registry's implementations (``lowprec.quant.sm90``), with the arguments ``config`` checks.
def quantize_codes(x: torch.Tensor, r) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize(x, r)``'s codes and scales, ``x`` viewed as [rows, cols]."""
    return quantize_by_recipe(x.reshape(-1, x.shape[-1]), r.name)


def quantize_dual_codes(x: torch.Tensor, r, r_t) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_dual(x, r, r_t)``'s codes and scales, both orientations."""
    return quantize_dual(x, t_rows=r_t.block[0])


def quantize_with_transpose_codes(x: torch.Tensor, r) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_with_transpose(x, r)``'s codes, scales and transposed codes."""
    return quantize_128x128_t(x.reshape(-1, x.shape[-1]), x.shape[-2])


def quantize_t_gathered_codes(rows: torch.Tensor, r, sources: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-major 1x128 codes and scales of ``rows`` gathered through ``sources``."""
    return quantize_t_gathered(rows, sources)
