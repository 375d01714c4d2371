"""Host wiring of the sm_100a block-scaled GEMM: compile (no GPU needed), operand preparation, launch.

Never run here: no Blackwell GPU is available. The kernel is registered with a first-use
self-check (``__init__``): on a real sm_100a device each configuration first runs a small random
problem against the reference, and serves real inputs only if it agrees.
"""

from __future__ import annotations

import functools

import torch

from ...quant.layouts import to_blocked
from ...runtime import compile_for_arch, kernel_cache, on_device
from ...tensor import QuantizedTensor
from .config import DEEPSEEK_PAIR, TILE_M, GemmConfig, config_for, pair_of

__all__ = ["build_kernel", "compile_kernel", "kernel_operands", "gemm_quantized", "grouped_gemm_quantized", "probe",
           "grouped_probe", "close_enough"]

ARCH = "sm_100a"


def build_kernel(config, arch: str = ARCH):
    """Compile one ``GemmConfig`` on fake pointers and sizes, uncached; keeps PTX and cubin
    (``lowprec.runtime.compile.sass_of`` disassembles the result)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    from .blockscaled_gemm import BlockScaledGemmSm100

    kernel = BlockScaledGemmSm100(config)

    def fake_ptr(dtype, align):  # a placeholder address: the compile reads only type and alignment
        return make_ptr(dtype, align, cute.AddressSpace.gmem, assumed_align=align)

    a, b = fake_ptr(kernel.ab_dtype, 16), fake_ptr(kernel.ab_dtype, 16)
    sfa, sfb = fake_ptr(kernel.sf_dtype, 16), fake_ptr(kernel.sf_dtype, 16)
    d = fake_ptr(kernel.d_dtype, 32)
    alpha, bias, counts = fake_ptr(cutlass.Float32, 4), fake_ptr(cutlass.Float32, 16), fake_ptr(cutlass.Int32, 4)
    sizes = [cutlass.Int32(0)] * 5  # m, n, k, l, sm_count: dynamic
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=False)
    return compile_for_arch(kernel, a, b, sfa, sfb, d, alpha, bias, counts, *sizes, stream, arch=arch, tvm_ffi=False)


@functools.cache
def compile_kernel(config: GemmConfig, arch: str = ARCH):
    """The launchable kernel, compiled once per configuration through the kernel cache."""
    return kernel_cache.get("gemm_sm100", {"config": str(config)}, arch, lambda: build_kernel(config, arch))


def kernel_operands(a, b) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's A, B (codes as stored: E4M3 bytes, or two E2M1 codes per byte, K contiguous;
    ``[M, K]`` or a batch ``[L, M, K]``) and its SFA, SFB: the scale grids as raw bytes in the
    128x4 blocked layout of cuBLAS (``lowprec.quant.layouts.to_blocked``), one batch item after
    the other."""
    a_codes, b_codes = a.data.contiguous(), b.data.contiguous()
    if pair_of(a, b) == DEEPSEEK_PAIR:  # power-of-two FP32 scales -> E8M0 per 32-wide block
        k_blocks = a.shape[-1] // 32
        sa = _e8m0_of_pow2(a.scale).repeat_interleave(4, dim=-1)[..., :k_blocks]
        sb = _e8m0_of_pow2(b.scale).repeat_interleave(128, dim=-2)[..., : b.shape[-2], :]
        sb = sb.repeat_interleave(4, dim=-1)[..., :k_blocks]
        return a_codes, b_codes, to_blocked(sa), to_blocked(sb)
    sfa = to_blocked(a.scale.contiguous().view(torch.uint8))
    sfb = to_blocked(b.scale.contiguous().view(torch.uint8))
    return a_codes, b_codes, sfa, sfb


def _e8m0_of_pow2(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8) of power-of-two FP32 scales: their biased exponent."""
    return ((scale.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def gemm_quantized(a, b, out_dtype, bias):
    """``dequant(a) · dequant(b)ᵀ (+ bias)`` in ``out_dtype`` on sm_100a (``config.gemm_unsupported``
    holds); NVFP4's global scales multiply the FP32 accumulator in the epilogue."""
    return _launch(a, b, out_dtype, bias, config_for(a, b, out_dtype, bias))


def grouped_gemm_quantized(a, b, out_dtype, group_ends, masked_counts):
    """``lowprec.grouped_gemm`` (``config.grouped_unsupported`` holds). Masked layout: one batched
    launch over the experts, then the rows past each count zeroed (on the device). Contiguous
    layout: each group's rows (codes with their row-local scales) copied into a masked buffer of
    the longest group's rows (its size read on the host: a sync), the masked launch, and the
    output rows copied back."""
    if group_ends is not None:
        return _contiguous_as_masked(a, b, out_dtype, group_ends)
    d = _launch(a, b, out_dtype, None, config_for(a, b, out_dtype, None, grouped=True), masked_counts)
    rows = torch.arange(d.shape[1], device=d.device)
    return d.masked_fill_((rows[None, :] >= masked_counts.to(d.device)[:, None])[..., None], 0)


def _contiguous_as_masked(a, b, out_dtype, group_ends):
    # clamped to [0, M] (on the device, no sync): ends past M or decreasing (unchecked on CUDA) give
    # wrong rows, as grouped_gemm promises, never a gather past a's rows (a device-side assert)
    ends = group_ends.to(device=a.data.device, dtype=torch.int64).clamp(0, a.shape[0])
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    counts = (ends - starts).clamp_min(0)
    y = torch.zeros(a.shape[0], b.shape[-2], dtype=out_dtype, device=a.data.device)
    m_max = int(counts.max()) if counts.numel() else 0
    if m_max == 0:
        return y
    offsets = torch.arange(m_max, device=ends.device)
    valid = offsets[None, :] < counts[:, None]  # [E, m_max]
    rows = torch.where(valid, starts[:, None] + offsets[None, :], 0)  # the rows past a count: row 0, ignored
    masked = QuantizedTensor(a.data[rows], a.scale[rows], a.recipe, (b.shape[0], m_max, a.shape[1]), a.dtype,
                             a.global_scale)
    d = grouped_gemm_quantized(masked, b, out_dtype, None, counts.to(torch.int32))
    return y.index_copy_(0, rows[valid], d[valid])


def _launch(a, b, out_dtype, bias, config: GemmConfig, counts: torch.Tensor | None = None) -> torch.Tensor:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    from .blockscaled_gemm import _DTYPES, _OUT

    batch = a.shape[0] if a.dim() == 3 else 1
    m, k = a.shape[-2:]
    n = b.shape[-2]
    a_codes, b_codes, sfa, sfb = kernel_operands(a, b)
    device = a.data.device
    d = torch.empty(*a.shape[:-1], n, dtype=out_dtype, device=device)
    alpha = (a.global_scale * b.global_scale).float().reshape(1) if a.global_scale is not None else _one(device)
    bias32 = bias.float().contiguous() if bias is not None else alpha  # read only with has_bias
    counts32 = counts.to(device=device, dtype=torch.int32).contiguous() if config.masked else alpha  # read if masked
    ab_dtype, sf_dtype = _DTYPES[config.element_format]

    def ptr(t, dtype, align):
        return make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)

    with on_device(d.device):
        stream = cuda.CUstream(torch.cuda.current_stream(d.device).cuda_stream)
        compile_kernel(config)(ptr(a_codes, ab_dtype, 16), ptr(b_codes, ab_dtype, 16), ptr(sfa, sf_dtype, 16),
                               ptr(sfb, sf_dtype, 16), ptr(d, _OUT[config.out_dtype], 32),
                               ptr(alpha, cutlass.Float32, 4), ptr(bias32, cutlass.Float32, 16),
                               ptr(counts32, cutlass.Int32, 4), cutlass.Int32(m),
                               cutlass.Int32(n), cutlass.Int32(k), cutlass.Int32(batch),
                               cutlass.Int32(_sm_count(device)), stream)
    return d


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


_ONES: dict = {}


def _one(device) -> torch.Tensor:
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return one


# ----------------------------------------------------------------------------- first-use self-check
def _quantize_pair(pair: tuple[str, str], a: torch.Tensor, b: torch.Tensor):
    from ...quant import quantize

    if pair == DEEPSEEK_PAIR:
        return quantize(a, pair[0], pow2_scale=True), quantize(b, pair[1], pow2_scale=True)
    return quantize(a, pair[0]), quantize(b, pair[1])


def probe(check: tuple[tuple[str, str], GemmConfig], device: torch.device) -> tuple:
    """A small random problem of the self-check configuration ``(pair, config)``: M and N off the
    tile, two K tiles."""
    pair, config = check
    g = torch.Generator(device=device).manual_seed(0)
    # one tile past the configuration's last full cluster tile: a pair 328 rows, two pairs 584
    m, n, k = 200 + config.cluster_rows - TILE_M, config.tile_n + 48, 2 * config.tile_k
    a, b = _quantize_pair(pair, torch.randn(m, k, device=device, generator=g),
                          torch.randn(n, k, device=device, generator=g))
    bias = torch.randn(n, device=device, generator=g) if config.has_bias else None
    return a, b, getattr(torch, config.out_dtype), bias


def grouped_probe(check: tuple[str, tuple[str, str], GemmConfig], device: torch.device) -> tuple:
    """A small random grouped problem of the check's layout: three experts, one of ``L`` = 200 rows
    (328 for a CTA pair: the longest, the configuration's own), one of 7, one empty (masked:
    ``[3, L, K]``; contiguous: L + 7 rows and 13 past the last group, which stay zero); N off the
    tile, two K tiles."""
    layout, pair, config = check
    g = torch.Generator(device=device).manual_seed(0)
    n, k = config.tile_n + 48, 2 * config.tile_k
    longest = 200 + config.tile_m - TILE_M
    rows = (3, longest) if layout == "masked" else (longest + 20,)
    a, b = _quantize_pair(pair, torch.randn(*rows, k, device=device, generator=g),
                          torch.randn(3, n, k, device=device, generator=g))
    out = getattr(torch, config.out_dtype)
    if layout == "masked":
        return a, b, out, None, torch.tensor([longest, 7, 0], dtype=torch.int32, device=device)
    return a, b, out, torch.tensor([longest, longest + 7, longest + 7], dtype=torch.int32, device=device), None


def close_enough(result: torch.Tensor, expected: torch.Tensor) -> bool:
    """The output dtype's rounding: relative L2 error under 1%, all finite."""
    r, e = result.double(), expected.double()
    if r.shape != e.shape or not bool(torch.isfinite(r).all()):
        return False
    return float((r - e).norm() / e.norm().clamp_min(1e-30)) < 1e-2
