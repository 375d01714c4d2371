"""Host side of the sm_90a weight-only GEMMs (NVFP4 and FP8 weights): tile and split choice, compile
cache, launch; and NVFP4's prefill path (the weight decoded to bf16 once, then cuBLAS)."""

from __future__ import annotations

import functools
import weakref

import torch

from ...runtime import ffi_entry, kernel_cache, on_device, sm_count, version_of
from ..weight_only import (
    CHUNK_BYTES,
    CHUNK_K,
    DECODE_EXP,
    FP8_CHUNK_BYTES,
    ROW_BYTES,
    SPLITS,
    TILE_MS,
    TILE_N,
    PackedFP8,
    PackedNVFP4,
    PackedNVFP4Experts,
)

__all__ = ["SHIPPED", "FP8_TILE_MS", "DEQUANT_MIN_M", "GROUPED_DEQUANT_MIN_WORK", "choose_tile_m", "ctas_per_sm",
           "warp_mma_for", "stages_for", "choose_split", "build_kernel", "compile_kernel", "build_dequant_kernel",
           "compile_dequant_kernel", "weight_only_nvfp4", "weight_only_fp8", "grouped_prefill",
           "grouped_weight_only_nvfp4"]

ARCH = "sm_90a"
_SMEM_PER_SM = 200 * 1024  # for the rings (the accumulator hand-off takes up to 32 KB more)
_MAX_STAGES = 8
_MIN_CHUNKS_PER_CTA = 4
# the widest token tile on mma.sync per format (0: wgmma always); measured in NOTES.md
WARP_MMA_MAX_TILE_M = {"nvfp4": 16, "fp8": 32}
# from this many tokens, NVFP4 takes its weight decoded to bf16 once and a cuBLAS GEMM (the
# crossover measured in NOTES.md, session 48)
DEQUANT_MIN_M = 1024
# grouped (MoE experts): the per-expert prefill path also needs this much work per expert on
# average (rows x N x K), else its host time per expert (~45 µs: the decode, the GEMM, the views)
# is most of the call (benchmarks/nvfp4_grouped_prefill_crossover.py; NOTES, session 49)
GROUPED_DEQUANT_MIN_WORK = 10**10
# the decoded weight is made in row slices of at most this many bytes (an LM head's would
# otherwise be a transient GB)
_DEQUANT_SLICE_BYTES = 256 << 20
# FP8 keeps two chunk accumulators besides the sum (promotion): 64 tokens is its widest tile
FP8_TILE_MS = tuple(t for t in TILE_MS if t <= 64)
_CHUNK_BYTES = {"nvfp4": CHUNK_BYTES, "fp8": FP8_CHUNK_BYTES}
# every (format, tile_m, splits, grouped) the launcher can pick: CI compiles them all
SHIPPED = (tuple(("nvfp4", tm, sp, grouped) for grouped in (False, True) for tm in TILE_MS for sp in SPLITS)
           + tuple(("fp8", tm, sp, False) for tm in FP8_TILE_MS for sp in SPLITS))


def choose_tile_m(m: int) -> int:
    """The narrowest token tile holding ``m`` tokens (``TILE_MS[-1]`` beyond)."""
    return next((t for t in TILE_MS if t >= m), TILE_MS[-1])


def ctas_per_sm(tile_m: int) -> int:
    """Resident CTAs per SM: 2 while the ``x`` tile is small (16 consumer warps per SM keep the
    weight stream going), 1 beyond (shared memory)."""
    return 2 if tile_m <= 32 else 1


def warp_mma_for(fmt: str, tile_m: int) -> bool:
    """Whether a ``tile_m``-token tile of ``fmt`` runs its products on ``mma.sync`` (at most
    ``WARP_MMA_MAX_TILE_M[fmt]`` tokens) instead of wgmma."""
    return tile_m <= WARP_MMA_MAX_TILE_M[fmt]


def stages_for(fmt: str, tile_m: int) -> int:
    """Ring depth: the stages a CTA's share of shared memory holds, at most 8."""
    return min(_MAX_STAGES, _SMEM_PER_SM // ctas_per_sm(tile_m) // (_CHUNK_BYTES[fmt] + tile_m * CHUNK_K * 2))


def choose_split(tiles: int, k_chunks: int, num_sms: int, resident: int | None = None) -> int:
    """Split-K: the fewest splits (a power of two, at most 8) that give about one CTA per SM,
    keeping at least ``_MIN_CHUNKS_PER_CTA`` chunks per CTA, and not past the ``resident`` CTAs
    the GPU holds at once: a second wave of half-length CTAs takes as long as one wave of whole
    ones (measured: benchmarks/weight_only_sweep.py; gemm NOTES, sessions 26-29 and 48)."""
    for splits in SPLITS:
        if tiles * splits >= 0.9 * num_sms or splits * 2 * _MIN_CHUNKS_PER_CTA > k_chunks:
            return splits
        if resident is not None and tiles * splits * 2 > resident:
            return splits
    return SPLITS[-1]


def build_kernel(fmt: str, tile_m: int, splits: int, arch: str = ARCH, grouped: bool = False):
    """Compile the ``fmt`` kernel for ``tile_m`` tokens and ``splits`` (``grouped``: the experts'
    weights stacked, token rows per expert) on fake tensors (no GPU needed), uncached."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from ...runtime import compile_for_arch
    from .weight_only import WeightOnlySm90

    x = make_fake_tensor(cutlass.BFloat16, (cute.sym_int(), cute.sym_int(divisibility=8)),
                         stride=(cute.sym_int64(divisibility=8), 1), assumed_align=16)
    w = make_fake_tensor(cutlass.Uint8, (cute.sym_int(), cute.sym_int(), ROW_BYTES),
                         stride=(cute.sym_int64(divisibility=ROW_BYTES), ROW_BYTES, 1), assumed_align=128)
    y = make_fake_tensor(cutlass.BFloat16, (cute.sym_int(), cute.sym_int()), stride=(cute.sym_int64(), 1),
                         assumed_align=2)
    bias = make_fake_tensor(cutlass.BFloat16, (cute.sym_int(),), stride=(1,), assumed_align=2)
    scale = make_fake_tensor(cutlass.Float32, (cute.sym_int(), cute.sym_int()), stride=(cute.sym_int64(), 1),
                             assumed_align=4)
    work = make_fake_tensor(cutlass.Float32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    group_ends = make_fake_tensor(cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    kernel = WeightOnlySm90(fmt, tile_m, stages_for(fmt, tile_m), ctas_per_sm(tile_m), splits,
                            warp_mma_for(fmt, tile_m), grouped)
    return compile_for_arch(kernel, x, w, y, bias, scale, work, group_ends, cutlass.Int32(1), cutlass.Int32(0),
                            make_fake_stream(use_tvm_ffi_env_stream=True), arch=arch, tvm_ffi=True)


@functools.cache
def compile_kernel(fmt: str, tile_m: int, splits: int, arch: str = ARCH, grouped: bool = False):
    """The launchable kernel, compiled once per (fmt, tile_m, splits, arch, grouped) through the
    kernel cache."""
    return ffi_entry(kernel_cache.get(f"weight_only_{fmt}", {"tile_m": tile_m, "stages": stages_for(fmt, tile_m),
                                                             "ctas_per_sm": ctas_per_sm(tile_m), "splits": splits,
                                                             "warp_mma": warp_mma_for(fmt, tile_m),
                                                             "grouped": grouped},
                                      arch, lambda: build_kernel(fmt, tile_m, splits, arch, grouped)))


def build_dequant_kernel(arch: str = ARCH):
    """Compile the NVFP4 -> bf16 weight kernel on fake tensors (no GPU needed), uncached."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from ...runtime import compile_for_arch
    from .nvfp4_dequant import NVFP4DequantSm90

    words = make_fake_tensor(cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=16)
    out = make_fake_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int()), stride=(cute.sym_int64(), 1),
                           assumed_align=4)
    return compile_for_arch(NVFP4DequantSm90(), words, out, cutlass.Int32(0), cutlass.Int32(1),
                            make_fake_stream(use_tvm_ffi_env_stream=True), arch=arch, tvm_ffi=True)


@functools.cache
def compile_dequant_kernel(arch: str = ARCH):
    """The launchable NVFP4 -> bf16 weight kernel, compiled once through the kernel cache."""
    return ffi_entry(kernel_cache.get("nvfp4_dequant", {}, arch, lambda: build_dequant_kernel(arch)))


_WORKSPACE: dict = {}  # (device, stream) -> FP32 split-K partials
# outgrown workspaces stay allocated: a CUDA graph captured earlier still writes to its own
_OUTGROWN: list = []


def _workspace(device: torch.device, floats: int) -> torch.Tensor:
    """Split-K partials of one launch; kernels on one stream reuse it in turn (a launch writes
    its partials only after the previous kernel on the stream has finished). Keyed by the raw
    stream handle: building a ``torch.cuda.Stream`` per call cost ~10 µs of host time."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    work = _WORKSPACE.get(key)
    if work is None or work.numel() < floats:
        if work is not None:
            _OUTGROWN.append(work)
        work = _WORKSPACE[key] = torch.empty(max(floats, 1 << 16), dtype=torch.float32, device=device)
    return work


_UNUSED: dict = {}  # device -> a small tensor for the bias / workspace / group arguments a launch does not read


def _unused(device: torch.device) -> torch.Tensor:
    t = _UNUSED.get(device)
    if t is None:
        t = _UNUSED[device] = torch.zeros(8, dtype=torch.bfloat16, device=device)
    return t


def weight_only_nvfp4(x: torch.Tensor, packed: PackedNVFP4, bias: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` bf16 ``[M, K]`` (unit stride along K, rows 16-byte aligned) -> ``x · dequant(W)ᵀ
    (+ bias)`` bf16 ``[M, N]``; ``bias`` bf16 ``[N]`` contiguous or None; ``out``: a bf16 ``[M, N]``
    view with unit stride along N to write (else a new tensor). From ``DEQUANT_MIN_M`` rows
    (outside CUDA-graph capture): the weight decoded to bf16, then cuBLAS; both paths round the
    FP32 sum once."""
    if x.shape[0] >= DEQUANT_MIN_M:
        global_scale = _host_value(packed.global_scale)
        if global_scale is not None:
            return _dequant_matmul(x, packed, bias, global_scale, out)
    return _launch("nvfp4", x, packed, packed.global_scale.view(1, 1), bias, out)


# id of a base tensor -> (a weak reference to it, {storage offset: (its version, the value)}): a
# global scale read to the host once per in-place update, not per call (a read is a sync).
# Tensors compare elementwise, so they cannot key a WeakKeyDictionary
_HOST_VALUES: dict = {}


def _host_value(scale: torch.Tensor) -> float | None:
    """A one-element tensor's value on the host, read again only after its tensor (or the one it
    views) is updated in place; None while the current stream captures a CUDA graph: a read
    there is not allowed, and a value baked into the graph would miss later updates."""
    if scale.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    base = scale if scale._base is None else scale._base
    entry = _HOST_VALUES.get(id(base))
    if entry is None or entry[0]() is not base:
        entry = _HOST_VALUES[id(base)] = (weakref.ref(base), {})
        weakref.finalize(base, _HOST_VALUES.pop, id(base), None)
    values, offset = entry[1], scale.storage_offset()
    hit = values.get(offset)
    if hit is None or hit[0] != version_of(base):
        hit = values[offset] = (version_of(base), float(scale.reshape(())))
    return hit[1]


def _dequant_matmul(x: torch.Tensor, packed: PackedNVFP4, bias: torch.Tensor | None,
                    global_scale: float, y: torch.Tensor | None = None) -> torch.Tensor:
    """``x · dequant(W)ᵀ (+ bias)`` into ``y`` (or a new tensor): the weight decoded to bf16
    (``code * scale * 2^-DECODE_EXP``, exact) in row slices, each a cuBLAS GEMM with FP32 alpha
    ``global_scale * 2^DECODE_EXP`` into its columns of the output (with a bias, through an FP32
    result: one more pass)."""
    m, n, k, device = x.shape[0], packed.n, packed.k, x.device
    if y is None:
        y = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    if n == 0:
        return y
    alpha = global_scale * 2.0 ** DECODE_EXP
    slice_rows = max(TILE_N, _DEQUANT_SLICE_BYTES // (2 * k) // TILE_N * TILE_N)
    words = packed.data.view(torch.int32).view(-1)
    kernel = compile_dequant_kernel()
    for r0 in range(0, n, slice_rows):
        r1 = min(n, r0 + slice_rows)
        w = torch.empty(r1 - r0, k, dtype=torch.bfloat16, device=device)
        with on_device(device):
            kernel(words, w.view(torch.int32), r0 // TILE_N, packed.k_chunks)
        out = y if r1 - r0 == n else y[:, r0:r1]
        if bias is None:  # beta = 0: out's contents are not read
            torch.addmm(out, x, w.t(), beta=0, alpha=alpha, out=out)
        else:  # in bf16, cuBLAS rounds the product before it adds the bias: add it in FP32
            out.copy_(torch.addmm(bias[r0:r1].float(), x, w.t(), alpha=alpha, out_dtype=torch.float32))
    return y


def weight_only_fp8(x: torch.Tensor, packed: PackedFP8, bias: torch.Tensor | None = None) -> torch.Tensor:
    """As :func:`weight_only_nvfp4` for an FP8 weight (128x128 block scales); ``M <= 64``."""
    return _launch("fp8", x, packed, packed.scale, bias)


def _launch(fmt: str, x: torch.Tensor, packed, scale: torch.Tensor, bias: torch.Tensor | None,
            y: torch.Tensor | None = None) -> torch.Tensor:
    m, n, device = x.shape[0], packed.n, x.device
    if y is None:
        y = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    if m == 0 or n == 0:
        return y
    tile_m = choose_tile_m(m)
    num_sms = sm_count(device)
    splits = choose_split(packed.n_tiles * -(-m // tile_m), packed.k_chunks, num_sms, num_sms * ctas_per_sm(tile_m))
    work = _workspace(device, splits * m * n) if splits > 1 else _unused(device).view(torch.float32)
    has_bias = bias is not None
    unused = _unused(device)
    with on_device(device):
        compile_kernel(fmt, tile_m, splits)(x, packed.tiles, y, bias if has_bias else unused, scale, work,
                                            unused.view(torch.int32), 1, int(has_bias))
    return y


def grouped_tiles(rows: int, experts: int) -> tuple[int, int]:
    """Grouped: ``(tile_m, grid token tiles)`` for ``rows`` rows over ``experts`` experts. The tile
    fits the mean rows of an expert that has any; the grid holds every non-empty tile however the
    rows fall: an expert of ``r`` rows has ``ceil(r / tile_m)``, so the ``busy`` = ``min(experts,
    rows)`` experts that can have rows have at most ``(rows + busy (tile_m - 1)) / tile_m``."""
    busy = min(experts, rows)
    tile_m = choose_tile_m(-(-rows // busy))
    return tile_m, (rows + busy * (tile_m - 1)) // tile_m


def grouped_weight_only_nvfp4(x: torch.Tensor, packed: PackedNVFP4Experts, group_ends: torch.Tensor,
                              zero_tail: bool = True) -> torch.Tensor:
    """``x`` bf16 ``[R, K]`` with expert ``e``'s rows at ``group_ends[e-1]:group_ends[e]`` (int32
    ``[E]``, non-decreasing, at most ``R``, on the GPU) -> ``[R, N]``, each expert's rows times its
    weight; rows after ``group_ends[-1]`` are zero (``zero_tail``; else not written).

    Below ``DEQUANT_MIN_M`` rows and ``GROUPED_DEQUANT_MIN_WORK`` (rows x N x K) per expert on
    average, or under CUDA-graph capture: one launch of the grouped kernel, which reads
    ``group_ends`` on the GPU (no sync); the CTAs past the experts' tiles, and so every expert
    without rows, read no weight. From there (prefill): the row ranges read to the host (one sync)
    and each expert on :func:`weight_only_nvfp4` (its weight decoded to bf16 and cuBLAS from
    ``DEQUANT_MIN_M`` rows)."""
    rows, n, device = x.shape[0], packed.n, x.device
    y = (torch.zeros if zero_tail else torch.empty)(rows, n, dtype=torch.bfloat16, device=device)
    if rows == 0 or n == 0:
        return y
    if grouped_prefill(rows, packed.experts, n, packed.k) and not torch.cuda.is_current_stream_capturing():
        return _grouped_per_expert(x, packed, group_ends, y)
    tile_m, z_tiles = grouped_tiles(rows, packed.experts)
    num_sms = sm_count(device)
    splits = choose_split(packed.n_tiles * z_tiles, packed.k_chunks, num_sms, num_sms * ctas_per_sm(tile_m))
    work = _workspace(device, splits * rows * n) if splits > 1 else _unused(device).view(torch.float32)
    with on_device(device):
        compile_kernel("nvfp4", tile_m, splits, grouped=True)(
            x, packed.tiles, y, _unused(device), packed.global_scale.view(-1, 1), work, group_ends, z_tiles, 0)
    return y


def grouped_prefill(rows: int, experts: int, n: int, k: int) -> bool:
    """Whether a grouped GEMM of ``rows`` rows over ``experts`` ``[n, k]`` weights takes the
    per-expert prefill path (outside CUDA-graph capture): ``DEQUANT_MIN_M`` rows and
    ``GROUPED_DEQUANT_MIN_WORK`` (rows x N x K) per expert on average."""
    return rows >= DEQUANT_MIN_M * experts and rows * n * k >= GROUPED_DEQUANT_MIN_WORK * experts


def _grouped_per_expert(x: torch.Tensor, packed: PackedNVFP4Experts, group_ends: torch.Tensor,
                        y: torch.Tensor) -> torch.Tensor:
    """The grouped GEMM at prefill sizes (:func:`grouped_prefill`): the row ranges read to the
    host (one sync), then each expert's rows through :func:`weight_only_nvfp4`
    on its own weight into its rows of ``y``, which decodes the weight and runs cuBLAS from
    ``DEQUANT_MIN_M`` rows (else the weight-only kernel). Row ranges as the grouped kernel reads
    them: expert ``e`` owns ``[ends[e-1], min(ends[e], R))``, none where that is empty."""
    ends = group_ends.tolist()
    for e in range(packed.experts):
        start, end = max(ends[e - 1], 0) if e else 0, min(ends[e], x.shape[0])  # bad ends: no negative slice
        if end > start:
            weight_only_nvfp4(x[start:end], packed.expert(e), out=y[start:end])
    return y
