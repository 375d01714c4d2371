"""Host side of the sm_90a weight-only NVFP4 GEMM: tile and split choice, compile cache, launch."""

from __future__ import annotations

import functools

import torch

from ...runtime import ffi_entry, kernel_cache, on_device, sm_count
from ..weight_only import CHUNK_BYTES, CHUNK_K, ROW_BYTES, TILE_MS, PackedNVFP4

__all__ = ["TILE_MS", "SHIPPED", "choose_tile_m", "ctas_per_sm", "stages_for", "choose_split", "build_kernel", "compile_kernel",
           "weight_only_nvfp4"]

ARCH = "sm_90a"
_SMEM_PER_SM = 220 * 1024
_MAX_STAGES = 8
_WAVES = 1  # split-K aims the launch at one wave of resident CTAs (sweep: 1.53x bf16 vs 1.35x at 4 waves)
_MIN_CHUNKS_PER_CTA = 4
# every (tile_m, has_bias) the launcher can pick: CI compiles them all
SHIPPED = tuple((tm, b) for tm in TILE_MS for b in (False, True))


def choose_tile_m(m: int) -> int:
    """The narrowest token tile holding ``m`` tokens (``TILE_MS[-1]`` beyond)."""
    return next((t for t in TILE_MS if t >= m), TILE_MS[-1])


def ctas_per_sm(tile_m: int) -> int:
    """Resident CTAs per SM: 3 while the ``x`` tile is small (12 consumer warps per SM keep the
    weight stream going), fewer as it grows (shared memory)."""
    return 3 if tile_m <= 32 else 2 if tile_m == 64 else 1


def stages_for(tile_m: int) -> int:
    """Ring depth: the stages a CTA's share of shared memory holds, at most 8."""
    return min(_MAX_STAGES, _SMEM_PER_SM // ctas_per_sm(tile_m) // (CHUNK_BYTES + tile_m * CHUNK_K * 2))


def choose_split(tiles: int, k_chunks: int, resident: int) -> tuple[int, int]:
    """(chunks per split, splits): each tile's K chunks spread over CTAs so that the launch is
    about ``_WAVES`` waves of ``resident`` CTAs, each with at least ``_MIN_CHUNKS_PER_CTA`` chunks."""
    per = max(_MIN_CHUNKS_PER_CTA, -(-k_chunks * tiles // (_WAVES * resident)))
    per = min(per, k_chunks)
    return per, -(-k_chunks // per)


def build_kernel(tile_m: int, has_bias: bool, arch: str = ARCH):
    """Compile the kernel for ``tile_m`` on fake tensors (no GPU needed), uncached."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from ...runtime import compile_for_arch
    from .weight_only import WeightOnlyNVFP4Sm90

    x = make_fake_tensor(cutlass.BFloat16, (cute.sym_int(), cute.sym_int(divisibility=8)),
                         stride=(cute.sym_int64(divisibility=8), 1), assumed_align=16)
    w = make_fake_tensor(cutlass.Uint8, (cute.sym_int(), cute.sym_int(), ROW_BYTES),
                         stride=(cute.sym_int64(divisibility=ROW_BYTES), ROW_BYTES, 1), assumed_align=128)
    y = make_fake_tensor(cutlass.BFloat16, (cute.sym_int(), cute.sym_int()), stride=(cute.sym_int64(), 1),
                         assumed_align=2)
    bias = make_fake_tensor(cutlass.BFloat16, (cute.sym_int(),), stride=(1,), assumed_align=2)
    g = make_fake_tensor(cutlass.Float32, (1,), stride=(1,), assumed_align=4)
    work = make_fake_tensor(cutlass.Float32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    count = make_fake_tensor(cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    kernel = WeightOnlyNVFP4Sm90(tile_m, stages_for(tile_m), has_bias, ctas_per_sm(tile_m))
    return compile_for_arch(kernel, x, w, y, bias, g, work, count, cutlass.Int32(1),
                            make_fake_stream(use_tvm_ffi_env_stream=True), arch=arch, tvm_ffi=True)


@functools.cache
def compile_kernel(tile_m: int, has_bias: bool, arch: str = ARCH):
    """The launchable kernel, compiled once per (tile_m, has_bias, arch) through the kernel cache."""
    return ffi_entry(kernel_cache.get("weight_only_nvfp4", {"tile_m": tile_m, "stages": stages_for(tile_m),
                                                            "ctas_per_sm": ctas_per_sm(tile_m), "has_bias": has_bias},
                                      arch, lambda: build_kernel(tile_m, has_bias, arch)))


_SCRATCH: dict = {}  # (device, stream) -> (partials, arrival counters): counters return to zero


def _scratch(device: torch.device, floats: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device, torch.cuda.current_stream(device).stream_id)
    work, count = _SCRATCH.get(key, (None, None))
    if work is None or work.numel() < floats:
        work = torch.empty(max(floats, 1 << 16), dtype=torch.float32, device=device)
    if count is None or count.numel() < counters:
        count = torch.zeros(max(counters, 1024), dtype=torch.int32, device=device)
    _SCRATCH[key] = (work, count)
    return work, count


_NO_BIAS: dict = {}


def weight_only_nvfp4(x: torch.Tensor, packed: PackedNVFP4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` bf16 ``[M, K]`` (unit stride along K, rows 16-byte aligned) -> ``x · dequant(W)ᵀ
    (+ bias)`` bf16 ``[M, N]``; ``bias`` bf16 ``[N]`` contiguous or None."""
    m, k = x.shape
    n = packed.n
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    if m == 0 or n == 0:
        return y
    tile_m = choose_tile_m(m)
    n_tiles, k_chunks, m_tiles = packed.n_tiles, packed.k_chunks, -(-m // tile_m)
    per, splits = choose_split(n_tiles * m_tiles, k_chunks, sm_count(x.device) * ctas_per_sm(tile_m))
    work, count = _scratch(x.device, splits * m * n if splits > 1 else 0, n_tiles * m_tiles)
    if bias is None:
        bias = _NO_BIAS.get(x.device)
        if bias is None:
            bias = _NO_BIAS[x.device] = torch.zeros(1, dtype=torch.bfloat16, device=x.device)
        has_bias = False
    else:
        has_bias = True
    w = packed.data.view(n_tiles, k_chunks * (CHUNK_BYTES // ROW_BYTES), ROW_BYTES)
    with on_device(x.device):
        compile_kernel(tile_m, has_bias)(x, w, y, bias, packed.global_scale, work, count, per)
    return y

