"""Host wiring of the sm_90a FP8 block-scaled GEMM: validation, tile heuristic, compile cache,
launch.

Public:
    gemm_blockwise_fp8(a, a_scale, b, b_scale, out_dtype=torch.bfloat16, bias=None, ..., b_block_n=None) -> D
    compile_only(config, arch="sm_90a", ...) -> compiled kernel (no GPU needed)
    choose_config(m, n, k, b_block_n=128, num_sms=132) -> TileConfig
    SHIPPED_CONFIGS: every TileConfig the heuristic can pick.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import torch

from ...runtime import ffi_entry, on_device, sm_count
from .config import B_BLOCK_N, MN_MULTIPLE, SCALE_BLOCK, WGRAD_N_MULTIPLE, group_box_rows

_ARCH_DEFAULT = "sm_90a"
_TILE_N_CHOICES = (16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176)
_SPLIT_TILE_N = (64,)  # 64x128 split (fp32 partials) spills 4 bytes with mma_overlap
_SPLITS = (2, 4, 8)
_TILE_N_PER_COL_MAX = 128  # 1x128 B scales keep tile_n/4 column scales live in registers
_PER_COL_TWO_WAVE_MIN_M = 4096  # 256x112 lost to 128x128 at M = 1024 (4 M tiles: too few)


def _tile_config_cls():
    from .config import TileConfig

    return TileConfig


def _shipped_configs():
    TileConfig = _tile_config_cls()
    cfgs = []
    for bm, clusters in ((64, ((1, 1), (1, 2))), (128, ((1, 1), (2, 1)))):
        for cm, cn in clusters:
            for bn in _TILE_N_CHOICES:
                cfgs.append(TileConfig(tile_m=bm, tile_n=bn, cluster_m=cm, cluster_n=cn))
    cfgs.append(TileConfig(tile_m=128, tile_n=128, cluster_m=2, raster_along_m=False, swizzle=4))
    cfgs.append(TileConfig(tile_m=128, tile_n=128, cluster_n=2))
    cfgs.append(TileConfig(tile_m=128, tile_n=128, cluster_n=2, swizzle=8))
    cfgs.append(TileConfig(tile_m=256, tile_n=112, cluster_n=2, raster_along_m=False, swizzle=8))
    cfgs.extend(_wide_config(bm, bn) for bm, bn in _WIDE_TILES if (bm, bn) != (128, 128))
    # 64 < M <= 128: both M tiles of a 2-CTA cluster share the B tile
    cfgs.extend(TileConfig(tile_m=64, tile_n=bn, cluster_m=2) for bn in (16, 32, 64, 128))
    # split-K for small M (few tiles, long K): fp32 partials reduced on the host side
    for bm in (64, 128):
        for bn in _SPLIT_TILE_N:
            for sk in _SPLITS:
                cfgs.append(TileConfig(tile_m=bm, tile_n=bn, split_k=sk))
    return tuple(cfgs)


def __getattr__(name):  # lazy: importing this module must not import cutlass
    if name == "SHIPPED_CONFIGS":
        return _shipped_configs()
    raise AttributeError(name)


# ----------------------------------------------------------------------------- heuristic
# Large-M tiles (in 1x2 clusters, A multicast) and their relative throughput per tile area at
# K >= 1024, from same-run sweeps on the H100 (NOTES, session 24): 256x128 (two 128-row waves
# per consumer pair, DeepGEMM's tile) +4-10% over 128x128 at K = 1536..16384; 128x192 wins where
# its wave count is lower. At K = 512 (4 K blocks to spread a tile's prologue and epilogue over)
# 128x128 stays ahead.
_WIDE_TILES = {(128, 128): 1.0, (128, 192): 1.03, (256, 128): 1.08}
_WIDE_TILE_MIN_K = 1024
# Per-SM ceilings used by the cost model (H100 SXM measured: FP8 dense ~1250 TFLOPS via cuBLAS,
# ~3.0 TB/s copy). Only ratios matter for the choice.
_SM_FLOPS = 1250e12 / 132
_HBM_BW = 3.0e12


def _estimate_time(m: int, n: int, k: int, bm: int, bn: int, num_sms: int) -> float:
    tiles_m = -(-m // bm)
    tiles_n = -(-n // bn)
    tiles = tiles_m * tiles_n
    waves = -(-tiles // num_sms)
    active = min(tiles, num_sms)
    kp = -(-k // SCALE_BLOCK) * SCALE_BLOCK
    # tensor-core time of one tile; small N tiles and M=64 tiles run the wgmma less efficiently
    eff = min(1.0, (bn / 128.0) ** 0.35) * (0.85 if bm == 64 else 1.0)
    t_flop = 2.0 * bm * bn * kp / (_SM_FLOPS * eff)
    # bytes a tile streams; all active CTAs share HBM bandwidth (L2 absorbs re-reads of the
    # operand shared by many tiles, so count the unique bytes of one wave spread over its CTAs)
    wave_m = min(tiles_m, max(1, active // max(1, min(tiles_n, active))))
    wave_n = min(tiles_n, -(-active // wave_m))
    uniq = (wave_m * bm + wave_n * bn) * kp
    t_mem = uniq / _HBM_BW
    per_wave = max(t_flop, t_mem) + 2.0e-6  # + fixed per-tile cost (prologue, epilogue)
    return waves * per_wave


def _wide_config(bm: int, bn: int):
    """The large-M config of a tile: 1x2 clusters; 256x128 rasterized along N in groups of 8
    (+2-6% over along M at 4096x7168x16384, 4096x4096x7168 and 8192^3, NOTES session 24)."""
    if bm == 256:
        return _tile_config_cls()(tile_m=bm, tile_n=bn, cluster_n=2, raster_along_m=False, swizzle=8)
    return _tile_config_cls()(tile_m=bm, tile_n=bn, cluster_n=2)


def _wide_tile(m: int, n: int, k: int, num_sms: int) -> tuple[int, int]:
    """The large-M tile with the least estimated time: waves (a persistent CTA runs its tiles one
    after the other, so a partial last wave costs a whole one) x tile area / throughput."""
    def cost(tile):
        bm, bn = tile
        tiles = -(-m // bm) * -(-n // bn)
        return -(-tiles // num_sms) * bm * bn / _WIDE_TILES[tile]

    if k < _WIDE_TILE_MIN_K:
        return 128, 128
    return min(_WIDE_TILES, key=lambda t: (cost(t), t))


@functools.lru_cache(maxsize=4096)
def choose_config(m: int, n: int, k: int, b_block_n: int = SCALE_BLOCK, num_sms: int = 132):
    """Tile configuration for a problem whose B scale blocks are ``b_block_n`` x 128 (128, 16 or
    1; deterministic: the result depends only on the args).

    Rules from sweeps on H100 (NOTES.md, v3, v7 and sessions 11, 24): large M -> 2-CTA clusters
    along N (A multicast) of 128x128, 128x192 or 256x128 tiles, whichever runs in the fewest
    waves for its throughput (``_wide_tile``; 128x128 at M >= 8192 and N >= 4096: rasterized in
    groups of 8 N tiles; 1x128 B scales: 128x128 in clusters along M, rasterized along N);
    M <= 64 -> 64x64 tiles, narrower when that leaves SMs idle; 64 < M <= 128 -> two 64-row tiles in a 2-CTA cluster
    sharing B (multicast), up to 128 wide; in between, the cost model. B scales per 16 columns
    (``b_block_n`` 16: a scale product per 16 columns, the promotion's cost close to the block
    kind's) take the block kind's large-M tiles: 256x128 ran 1150-1161 TFLOPS at the Llama-3-8B
    weight gradients against 1012-1078 for 256x112 (H200, NOTES session 45).
    """
    TileConfig = _tile_config_cls()
    tiles_m128 = -(-m // 128)
    tiles_n128 = -(-n // 128)
    if m >= 512 and tiles_m128 * tiles_n128 >= num_sms:
        if b_block_n == 1:
            # weight-gradient GEMMs (1x128 B scales). From M = 4096: two-wave 256x112 tiles in 2-CTA
            # clusters along N, +3-14% over 128x128 on the Llama-3-8B wgrads (NOTES session 36);
            # below, 128x128 rasterized along N in groups of 4 M tiles (NOTES v8, session 11)
            if m >= _PER_COL_TWO_WAVE_MIN_M:
                return TileConfig(tile_m=256, tile_n=112, cluster_n=2, raster_along_m=False, swizzle=8)
            return TileConfig(tile_m=128, tile_n=128, cluster_m=2, raster_along_m=False, swizzle=4)
        bm, bn = _wide_tile(m, n, k, num_sms)
        if (bm, bn) == (128, 128) and tiles_m128 >= 64 and tiles_n128 >= 32:
            # a plain wave along M would stream all of a tall A from HBM once per N column pair:
            # groups of 8 N tiles keep A's rows in L2; +6-12% over the 2x1 N-rasterized config
            # on every M >= 8192 shape of NOTES session 11 (8192^3 included)
            return TileConfig(tile_m=128, tile_n=128, cluster_n=2, swizzle=8)
        return _wide_config(bm, bn)
    if m <= 64:
        for bn in (64, 32, 16):
            if -(-n // bn) >= 0.75 * num_sms:
                break
        return TileConfig(tile_m=64, tile_n=bn)
    if m <= 128:
        for bn in (128, 64, 32, 16):
            if 2 * (-(-n // bn)) >= 0.75 * num_sms:
                break
        return TileConfig(tile_m=64, tile_n=bn, cluster_m=2)
    bms = (64, 128)
    best = None
    for bm in bms:
        for bn in _TILE_N_CHOICES:
            if b_block_n == 1 and bn > _TILE_N_PER_COL_MAX:
                continue
            if bn > 16 and bn >= 2 * n:
                continue
            t = _estimate_time(m, n, k, bm, bn, num_sms)
            key = (t, -bm, -bn)
            if best is None or key < best[0]:
                best = (key, TileConfig(tile_m=bm, tile_n=bn))
    return best[1]


# ----------------------------------------------------------------------------- compile
_TVM_FFI: bool | None = None


def _use_tvm_ffi() -> bool:
    global _TVM_FFI
    if _TVM_FFI is None:
        _TVM_FFI = importlib.util.find_spec("tvm_ffi") is not None
    return _TVM_FFI


def _cutlass_dtype(torch_dtype):
    import cutlass

    return {
        torch.bfloat16: cutlass.BFloat16,
        torch.float16: cutlass.Float16,
        torch.float32: cutlass.Float32,
    }[torch_dtype]


def build_kernel(config, out_dtype, b_block_n: int, bias_dtype, num_sms: int, arch: str = _ARCH_DEFAULT,
                 grouping: str | None = None):
    """Compile one configuration (B scale blocks ``b_block_n`` x 128) on fake tensors (no GPU
    needed), uncached; keeps PTX and cubin."""
    import cutlass
    import cutlass.cute as cute

    from .blockscaled_gemm import BlockScaledGemmSm90

    split = config.split_k > 1
    # split-K: the kernel writes fp32 partials [M, N, split_k]; bias and the cast are host-side
    c_out = cutlass.Float32 if split else _cutlass_dtype(out_dtype)
    c_bias = _cutlass_dtype(bias_dtype) if (bias_dtype is not None and not split) else None
    kernel = BlockScaledGemmSm90(config, c_out, b_block_n, c_bias, num_sms, grouping)

    sym_m = cute.sym_int()
    sym_n = cute.sym_int(divisibility=16)
    sym_k = cute.sym_int(divisibility=16)
    sym_kb = cute.sym_int()
    sym_sb_rows = cute.sym_int()
    fake = cute.runtime.make_fake_tensor
    # kgrouped: A [N_out, K] while D stacks the groups' outputs [E * N_out, P]
    sym_am = cute.sym_int() if grouping == "kgrouped" else sym_m
    a = fake(cutlass.Uint8, (sym_am, sym_k), stride=(cute.sym_int64(divisibility=16), 1), assumed_align=16)
    # grouped: b is [E * N, K], its rows no longer match D's columns
    b_rows = cute.sym_int(divisibility=16) if grouping is not None else sym_n
    b = fake(cutlass.Uint8, (b_rows, sym_k), stride=(cute.sym_int64(divisibility=16), 1), assumed_align=16)
    if split:
        d = fake(c_out, (sym_m, sym_n, config.split_k),
                 stride=(cute.sym_int64(divisibility=4), 1, cute.sym_int64(divisibility=4)), assumed_align=16)
    else:
        d = fake(c_out, (sym_m, sym_n), stride=(cute.sym_int64(divisibility=8), 1), assumed_align=16)
    # scales are loaded by TMA: 16-byte aligned base and leading dimension (see _tma_scales)
    sa = fake(cutlass.Float32, (sym_am, sym_kb), stride=(1, cute.sym_int64(divisibility=4)), assumed_align=16)
    if b_block_n < SCALE_BLOCK:  # N-contiguous, zero-padded (see _prep_b_scale_per_col, _prep_b_scale_groups)
        sb = fake(cutlass.Float32, (sym_sb_rows, sym_kb), stride=(1, cute.sym_int64(divisibility=4)), assumed_align=16)
    else:
        sb = fake(cutlass.Float32, (sym_sb_rows, sym_kb), stride=(cute.sym_int64(divisibility=4), 1), assumed_align=16)
    if c_bias is not None:
        bias = fake(c_bias, (sym_n,), stride=(1,), assumed_align=4)
    else:
        bias = fake(cutlass.Float32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    group = fake(cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    tvm = _use_tvm_ffi()
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm)
    from ...runtime import compile_for_arch

    return compile_for_arch(kernel, a, b, d, sa, sb, bias, group, cutlass.Int32(0), stream, arch=arch,
                            tvm_ffi=tvm)


@functools.cache
def _get_compiled(config, out_dtype, b_block_n, bias_dtype, num_sms, arch=_ARCH_DEFAULT, grouping=None):
    """The launchable kernel, compiled once per key through the package's kernel cache (the
    lru_cache in front keeps the per-launch lookup to one tuple hash)."""
    from ...runtime import kernel_cache

    if config.split_k > 1:  # one kernel per split config: fp32 partials, no bias
        out_dtype, bias_dtype = torch.float32, None
    key = dict(dataclasses.asdict(config), out=out_dtype, b_block_n=int(b_block_n), bias=bias_dtype,
               num_sms=int(num_sms), tvm_ffi=_use_tvm_ffi(), grouping=grouping)
    return kernel_cache.get("gemm_sm90_blockscaled", key, arch,
                            lambda: build_kernel(config, out_dtype, b_block_n, bias_dtype, num_sms, arch, grouping))


def compile_only(
    config=None,
    arch: str = _ARCH_DEFAULT,
    out_dtype=torch.bfloat16,
    b_block_n: int = SCALE_BLOCK,
    bias_dtype=None,
    num_sms: int = 132,
    grouping: str | None = None,
):
    """Compile one configuration on fake tensors (no GPU needed) and return the compiled object
    (cached; keeps ``__ptx__`` and ``__cubin__``: ``lowprec.runtime.compile.sass_of`` disassembles
    it, with ``nvdisasm`` from PATH or the pip package ``nvidia-cuda-nvdisasm``)."""
    if config is None:
        config = _tile_config_cls()()
    return _get_compiled(config, out_dtype, b_block_n, bias_dtype, num_sms, arch, grouping)


# ----------------------------------------------------------------------------- launch


def _check(cond: bool, msg):
    """Raise ValueError(msg) unless cond; ``msg`` may be a function, so that a message built
    from the operands is only formatted on failure (launches are hot)."""
    if not cond:
        raise ValueError(msg() if callable(msg) else msg)


def _check_out_dtype(out_dtype):
    _check(out_dtype in (torch.bfloat16, torch.float16, torch.float32),
           lambda: f"out_dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")


def _check_on_cuda_like_a(a, **others):
    """``a`` on a CUDA device and every other tensor given (None: skipped) on the same one."""
    dev = a.device
    _check(dev.type == "cuda", lambda: f"a: expected a CUDA tensor, got device {dev}")
    for name, t in others.items():
        if t is not None and t.device != dev:  # a plain raise: a lambda would not bind the loop variables
            raise ValueError(f"{name}: on {t.device}, expected {dev} like a")


def _validate(a, a_scale, b, b_scale, out_dtype, bias, b_block_n=None):
    for name, t in (("a", a), ("a_scale", a_scale), ("b", b), ("b_scale", b_scale)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name}: expected 2 dims, got shape {tuple(t.shape)}")
    _check(a.dtype == torch.float8_e4m3fn, lambda: f"a: expected torch.float8_e4m3fn, got {a.dtype}")
    _check(b.dtype == torch.float8_e4m3fn, lambda: f"b: expected torch.float8_e4m3fn, got {b.dtype}")
    m, k = a.shape
    n, kb_ = b.shape
    _check(kb_ == k, lambda: f"b: K mismatch, a is [{m}, {k}] but b is [{n}, {kb_}] (b must be [N, K])")
    _check(m >= 1, lambda: f"a: M must be >= 1, got {m}")
    _check(n % MN_MULTIPLE == 0 and n > 0, lambda: f"b: N must be a positive multiple of {MN_MULTIPLE}, got {n}")
    _check(k % MN_MULTIPLE == 0 and k > 0, lambda: f"a: K must be a positive multiple of {MN_MULTIPLE}, got {k}")
    _check(a.stride(1) == 1, lambda: f"a: must be K-major (stride(1) == 1), got strides {a.stride()}")
    _check(b.stride(1) == 1, lambda: f"b: must be K-major (stride(1) == 1), got strides {b.stride()}")
    _check(a.stride(0) % 16 == 0 or m == 1, lambda: f"a: row stride must be a multiple of 16, got {a.stride(0)}")
    _check(b.stride(0) % 16 == 0, lambda: f"b: row stride must be a multiple of 16, got {b.stride(0)}")
    _check(a.data_ptr() % 16 == 0, "a: data pointer must be 16-byte aligned")
    _check(b.data_ptr() % 16 == 0, "b: data pointer must be 16-byte aligned")
    kb = -(-k // SCALE_BLOCK)
    nb = -(-n // SCALE_BLOCK)
    _check(a_scale.dtype == torch.float32, lambda: f"a_scale: expected torch.float32, got {a_scale.dtype}")
    _check(b_scale.dtype == torch.float32, lambda: f"b_scale: expected torch.float32, got {b_scale.dtype}")
    _check(tuple(a_scale.shape) == (m, kb),
           lambda: f"a_scale: expected shape [{m}, {kb}] (1x128 blocks), got {tuple(a_scale.shape)}")
    if b_block_n is None:  # inferred from the shape: 128x128 or 1x128 blocks
        b_block_n = 128 if tuple(b_scale.shape) == (nb, kb) else 1
    _check(b_block_n in B_BLOCK_N, lambda: f"b_block_n: expected one of {B_BLOCK_N} or None, got {b_block_n!r}")
    ng = -(-n // b_block_n)
    _check(tuple(b_scale.shape) == (ng, kb),
           lambda: f"b_scale: expected shape [{ng}, {kb}] ({b_block_n}x128 blocks; or [{nb}, {kb}] / [{n}, {kb}] "
                   f"for 128x128 / 1x128 blocks), got {tuple(b_scale.shape)}")
    _check_out_dtype(out_dtype)
    if bias is not None:
        _check(isinstance(bias, torch.Tensor) and bias.dim() == 1 and bias.shape[0] == n,
               lambda: f"bias: expected a 1-D tensor of length N={n}, got {getattr(bias, 'shape', type(bias))}")
        _check(bias.dtype in (torch.float32, torch.bfloat16),
               lambda: f"bias: expected float32 or bfloat16, got {bias.dtype}")
    _check_on_cuda_like_a(a, a_scale=a_scale, b=b, b_scale=b_scale, bias=bias)
    return m, n, k, b_block_n


_N_PAD = 256  # >= every tile_n, so a tile never reads past the padded 1x128 B-scale rows


def _prep_b_scale_per_col(b_scale: torch.Tensor) -> torch.Tensor:
    """[N, KB] 1x128 B scales -> same values as an N-contiguous [N_pad, KB] view (stride (1, N_pad)),
    zero past N: the kernel then loads column scales with no clamping (one small copy of N*KB
    floats per call)."""
    n, kb = b_scale.shape
    n_pad = -(-n // _N_PAD) * _N_PAD
    buf = torch.empty(kb, n_pad, dtype=torch.float32, device=b_scale.device)
    buf[:, :n].copy_(b_scale.t())
    if n_pad > n:
        buf[:, n:].zero_()
    return buf.t()


def _prep_b_scale_groups(b_scale: torch.Tensor, tile_n: int, col_group: int) -> torch.Tensor:
    """[NG, KB] B scales of ``col_group``-row blocks -> N-contiguous, each ``tile_n``-wide tile's
    tile_n / col_group scales in a box of their own, zero-padded to 16 bytes (the kernel's TMA
    box: ``config.group_box_rows``); stride (1, ld)."""
    ng, kb = b_scale.shape
    per_tile = tile_n // col_group
    tiles = -(-ng // per_tile)
    buf = b_scale.new_zeros(kb, tiles, group_box_rows(tile_n, col_group))
    full = ng // per_tile
    if full:
        buf[:, :full, :per_tile].copy_(b_scale[:full * per_tile].t().reshape(kb, full, per_tile))
    if ng > full * per_tile:
        buf[:, full, :ng - full * per_tile].copy_(b_scale[full * per_tile:].t())
    return buf.view(kb, -1).t()


def _tma_a_scale(a_scale: torch.Tensor) -> torch.Tensor:
    """[M, KB] A scales as the kernel's TMA reads them: MN-major (stride (1, ld)), ld a multiple
    of 4, 16-byte aligned (what the 1x128 quantize kernels write: no copy then). Stricter than
    ``quant.layouts.is_mn_major_tma_aligned``, which accepts any stride on a size-1 dim: the
    compiled kernel fixes stride(0) = 1 and a leading dimension divisible by 4."""
    m, kb = a_scale.shape
    if a_scale.stride(0) == 1 and a_scale.stride(1) % 4 == 0 and a_scale.data_ptr() % 16 == 0:
        return a_scale
    ld = -(-m // 4) * 4
    buf = torch.zeros(kb, ld, dtype=torch.float32, device=a_scale.device)
    buf[:, :m].copy_(a_scale.t())
    return buf[:, :m].t()


def _tma_b_scale_blocks(b_scale: torch.Tensor) -> torch.Tensor:
    """[NB, KB] 128x128 B scales as the kernel's TMA reads them: K-contiguous, row stride a
    multiple of 4, 16-byte aligned (quantized weights with K % 512 == 0 need no copy)."""
    nb, kb = b_scale.shape
    if b_scale.stride(1) == 1 and b_scale.stride(0) % 4 == 0 and b_scale.data_ptr() % 16 == 0:
        return b_scale
    buf = torch.zeros(nb, -(-kb // 4) * 4, dtype=torch.float32, device=b_scale.device)
    buf[:, :kb].copy_(b_scale)
    return buf[:, :kb]


def gemm_blockwise_fp8(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    config=None,
    out: torch.Tensor | None = None,
    b_block_n: int | None = None,
) -> torch.Tensor:
    """D[M, N] = (A * sa) @ (B * sb)^T (+ bias), FP32 accumulation with per-K-block promotion.

    a: float8_e4m3fn [M, K] K-major; a_scale: fp32 [M, ceil(K/128)] (any strides; MN-major
    loads fastest); b: float8_e4m3fn [N, K] K-major; b_scale: fp32 [ceil(N/b_block_n),
    ceil(K/128)] for B's blocks of b_block_n rows x 128: 128 (weights), 16 or 1 (None: 128 or
    1, from b_scale's shape); bias: fp32/bf16 [N] or None; out: optional preallocated contiguous
    [M, N] tensor of ``out_dtype`` (written and returned).
    """
    _, _, _, b_block_n = _validate(a, a_scale, b, b_scale, out_dtype, bias, b_block_n)
    if out is not None:
        m, n = a.shape[0], b.shape[0]
        _check(out.shape == (m, n) and out.dtype == out_dtype and out.is_contiguous()
               and out.device == a.device,
               lambda: f"out: expected a contiguous [{m}, {n}] {out_dtype} tensor on {a.device}")
    return _run_dense(a, a_scale, b, b_scale, out_dtype, bias, b_block_n, config, out)


def _run_dense(a, a_scale, b, b_scale, out_dtype, bias, b_block_n: int, config=None, out=None) -> torch.Tensor:
    """The launch of :func:`gemm_blockwise_fp8` on valid operands (host work kept to what each
    call needs: eager small-M GEMMs are bound by it). ``b_block_n``: B's scale block rows (1, 16
    or 128)."""
    m, k = a.shape
    n = b.shape[0]
    dev = a.device
    num_sms = sm_count(dev)
    if config is None:
        config = choose_config(m, n, k, b_block_n, num_sms)
    split = config.split_k
    if split > 1:
        kt = -(-k // SCALE_BLOCK)
        _check(_split_ok(kt, split), lambda: f"config: split_k={split} leaves an empty split for K={k}")
    fn = _get_compiled(config, out_dtype, b_block_n, bias.dtype if bias is not None else None, num_sms)
    d = torch.empty((m, n), dtype=out_dtype, device=dev) if out is None else out
    a_scale = _tma_a_scale(a_scale)
    if b_block_n == SCALE_BLOCK:
        b_scale = _tma_b_scale_blocks(b_scale)
    elif b_block_n == 1:
        b_scale = _prep_b_scale_per_col(b_scale)
    else:
        b_scale = _prep_b_scale_groups(b_scale, config.tile_n, b_block_n)
    no_bias, no_group = _unused_args(dev)
    if split > 1:
        ws = torch.empty((split, m, n), dtype=torch.float32, device=dev).permute(1, 2, 0)
        _launch(fn, a, b, ws, a_scale, b_scale, no_bias, no_group)
        r = ws.sum(dim=2)  # fixed-order reduction: deterministic
        if bias is not None:
            r += bias.float()
        d.copy_(r)
        return d
    _launch(fn, a, b, d, a_scale, b_scale, no_bias if bias is None else _bias_arg(bias), no_group)
    return d


def _bias_arg(bias: torch.Tensor) -> torch.Tensor:
    """The bias as the kernel reads it (``build_kernel``: unit stride, 4-byte aligned): a copy where a
    view is not (a bf16 slice at an odd offset would fail TVM-FFI's alignment check)."""
    if bias.stride(0) == 1 and bias.data_ptr() % 4 == 0:
        return bias
    return bias.clone(memory_format=torch.contiguous_format)  # a fresh buffer: aligned


@functools.cache
def _unused_args(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Placeholders for the kernel arguments a config does not read (the bias of a GEMM without,
    the group ends of a dense one): empty tensors, so no memory is allocated (caching one in a
    CUDA graph pool would pin it there) and nothing is allocated per call."""
    return torch.empty(0, dtype=torch.float32, device=device), torch.empty(0, dtype=torch.int32, device=device)


def _split_ok(k_tiles: int, split: int) -> bool:
    per = -(-k_tiles // split)
    return split == 1 or (split - 1) * per < k_tiles


_entry = functools.cache(ffi_entry)  # per compiled kernel (compile_only keeps returning the compiled object)


def _launch(fn, a, b, d, a_scale, b_scale, bias_arg, group, m_max=0):
    if _use_tvm_ffi():  # launches on torch's current stream of a's device
        with on_device(a.device):
            _entry(fn)(a.view(torch.uint8), b.view(torch.uint8), d, a_scale, b_scale, bias_arg, group, m_max)
    else:  # pragma: no cover - slow path (~50 us per launch)
        with torch.cuda.device(a.device):
            import cuda.bindings.driver as cuda
            from cutlass.cute.runtime import from_dlpack

            args = [from_dlpack(t, assumed_align=16 if i < 5 else 4) for i, t in enumerate(
                (a.view(torch.uint8), b.view(torch.uint8), d, a_scale, b_scale, bias_arg, group))]
            fn(*args, m_max, cuda.CUstream(torch.cuda.current_stream().cuda_stream))


# ----------------------------------------------------------------------------- grouped
def choose_grouped_config(rows_per_group: float, n: int, k: int, num_groups: int, num_sms: int = 132):
    """Tile configuration of the grouped GEMM: 64-row tiles when groups are short (less work
    lost on each group's last tile); 192-wide N tiles when there are enough of them to fill the
    SMs (and they pair up where clusters are wanted), else 128-wide unless that leaves SMs idle;
    1x2 clusters (A multicast to two N tiles) for K >= 4096 when the N tiles pair up (measured
    +4-7% there, 0 to -3% at K <= 2048). 192 over 128: +3-17% on the MoE shapes of ``bench moe``
    in same-run A/Bs (NOTES "Grouped GEMMs", sessions 7 and 13)."""
    TileConfig = _tile_config_cls()
    bm = 64 if rows_per_group <= 64 else 128
    tiles_m = num_groups * max(1.0, rows_per_group / bm)
    long_k = k >= 4096
    bn = 128 if n >= 128 else n
    if bn == 128 and tiles_m * (-(-n // 128)) < num_sms:
        bn = 64
    tiles_wide = -(-n // 192)
    if bm == 128 and bn == 128 and n >= 192 and tiles_m * tiles_wide >= num_sms and (
            not long_k or tiles_wide % 2 == 0):
        bn = 192
    pairs = long_k and (-(-n // bn)) % 2 == 0
    return TileConfig(tile_m=bm, tile_n=bn, cluster_n=2 if pairs else 1)


def _check_grouped_config(config, n: int, what: str):
    """Grouped kernels take 1x1 or 1xc clusters whose c CTAs split a group's N tiles evenly."""
    _check(config.cluster_m == 1 and config.split_k == 1,
           lambda: f"config: grouped GEMMs take cluster_m=1 and split_k=1, got {config}")
    tiles_n = -(-n // config.tile_n)
    _check(tiles_n % config.cluster_n == 0,
           lambda: f"config: cluster_n={config.cluster_n} must divide the {tiles_n} N tiles of {what}={n} "
           f"(tile_n={config.tile_n})")


def _validate_grouped(a, a_scale, b, b_scale, group, out_dtype, masked):
    for name, t in (("a", a), ("a_scale", a_scale), ("b", b), ("b_scale", b_scale), ("group", group)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    _check(a.dtype == torch.float8_e4m3fn and b.dtype == torch.float8_e4m3fn,
           lambda: f"a, b: expected torch.float8_e4m3fn, got {a.dtype} and {b.dtype}")
    _check(b.dim() == 3, lambda: f"b: expected [E, N, K], got shape {tuple(b.shape)}")
    e, n, k = b.shape
    if masked:
        _check(a.dim() == 3 and a.shape[0] == e and a.shape[2] == k,
               lambda: f"a: expected [E={e}, M_max, K={k}], got shape {tuple(a.shape)}")
        rows = a.shape[0] * a.shape[1]
    else:
        _check(a.dim() == 2 and a.shape[1] == k, lambda: f"a: expected [M, K={k}], got shape {tuple(a.shape)}")
        rows = a.shape[0]
    kb, nb = -(-k // SCALE_BLOCK), -(-n // SCALE_BLOCK)
    _check(n % MN_MULTIPLE == 0 and n > 0, lambda: f"b: N must be a positive multiple of {MN_MULTIPLE}, got {n}")
    _check(k % MN_MULTIPLE == 0 and k > 0, lambda: f"b: K must be a positive multiple of {MN_MULTIPLE}, got {k}")
    _check(tuple(a_scale.shape) == (*a.shape[:-1], kb),
           lambda: f"a_scale: expected shape {(*a.shape[:-1], kb)} (1x128 blocks), got {tuple(a_scale.shape)}")
    _check(tuple(b_scale.shape) == (e, nb, kb),
           lambda: f"b_scale: expected shape {(e, nb, kb)} (128x128 blocks), got {tuple(b_scale.shape)}")
    _check(a_scale.dtype == torch.float32 and b_scale.dtype == torch.float32,
           lambda: f"a_scale, b_scale: expected torch.float32, got {a_scale.dtype} and {b_scale.dtype}")
    _check(tuple(group.shape) == (e,) and group.dtype in (torch.int32, torch.int64),
           lambda: f"group: expected an int32 or int64 tensor of shape ({e},), got {group.dtype} {tuple(group.shape)}")
    _check_out_dtype(out_dtype)
    _check_on_cuda_like_a(a, a_scale=a_scale, b=b, b_scale=b_scale, group=group)
    return rows, e, n, k


def grouped_gemm_blockwise_fp8(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    group_ends: torch.Tensor | None = None,
    masked_counts: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config=None,
) -> torch.Tensor:
    """One block-scaled GEMM per group against ``b[e]``, in one persistent kernel launch.

    Contiguous (``group_ends``, int32 [E] cumulative, non-decreasing, ≤ M): ``a`` [M, K] with
    1x128 scales [M, KB]; group e's rows ``ends[e-1]:ends[e]`` times ``b[e]ᵀ``; rows after the
    last group are zero. Groups need no padding: a tile that runs past its group's end stores
    only its own rows. Masked (``masked_counts`` [E]): ``a`` [E, M_max, K]; group e's first
    ``counts[e]`` rows, the other rows zero; returns [E, M_max, N].

    ``b``: E4M3 [E, N, K] with 128x128 scales [E, ceil(N/128), ceil(K/128)]. Group values are
    read on the device only (no host sync: CUDA-graph capturable) and are not validated there:
    values breaking the contract give wrong rows, never out-of-bounds accesses.
    """
    masked = masked_counts is not None
    _check((group_ends is not None) != masked, "pass exactly one of group_ends= or masked_counts=")
    group = masked_counts if masked else group_ends
    rows, e, n, k = _validate_grouped(a, a_scale, b, b_scale, group, out_dtype, masked)
    m_max = a.shape[1] if masked else 0
    out_shape = (e, m_max, n) if masked else (rows, n)
    d = torch.empty(out_shape, dtype=out_dtype, device=a.device)
    if rows == 0:
        return d
    num_sms = sm_count(a.device)
    if config is None:
        config = choose_grouped_config(m_max if masked else rows / e, n, k, e, num_sms)
    _check_grouped_config(config, n, "N")
    grouping = "masked" if masked else "contiguous"
    fn = _get_compiled(config, out_dtype, SCALE_BLOCK, None, num_sms, _ARCH_DEFAULT, grouping)
    a2 = a.reshape(rows, k)
    sa2 = _tma_a_scale(a_scale.reshape(rows, a_scale.shape[-1]))
    b2 = b.reshape(e * n, k)
    sb2 = _tma_b_scale_blocks(b_scale.reshape(-1, b_scale.shape[-1]))
    _check(b2.stride(1) == 1 and b2.stride(0) % 16 == 0 and b2.data_ptr() % 16 == 0,
           "b: must be contiguous along K with 16-byte aligned rows")
    _check(a2.stride(1) == 1 and (a2.stride(0) % 16 == 0 or rows == 1) and a2.data_ptr() % 16 == 0,
           "a: must be contiguous along K with 16-byte aligned rows")
    group = group if group.dtype == torch.int32 and group.is_contiguous() else group.to(torch.int32).contiguous()
    _launch(fn, a2, b2, d.view(rows, n), sa2, sb2, _unused_args(a.device)[0], group, m_max)
    return d


def grouped_gemm_wgrad_fp8(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_ends: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    config=None,
) -> torch.Tensor:
    """K-grouped GEMM for weight gradients: ``out[e] = (A·sa)[:, Kₑ] · (B·sb)[:, Kₑ]ᵀ``.

    a: E4M3 [N, K] and b: E4M3 [P, K], both with 1x128 scales along K ([N, KB], [P, KB]);
    group_ends: int32 [E] cumulative ends along K, each group starting and ending at a multiple
    of 128 (``lowprec.moe.quantize_k_grouped`` lays tokens out so). Returns [E, N, P]; empty
    groups give zeros. N must be a multiple of 64 (a tile never straddles two groups' outputs).
    Group values are read on the device only (no host sync).
    """
    for name, t in (("a", a), ("a_scale", a_scale), ("b", b), ("b_scale", b_scale), ("group_ends", group_ends)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    _check(a.dtype == torch.float8_e4m3fn and b.dtype == torch.float8_e4m3fn,
           lambda: f"a, b: expected torch.float8_e4m3fn, got {a.dtype} and {b.dtype}")
    _check(a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[1],
           lambda: f"a, b: expected [N, K] and [P, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    n, k = a.shape
    p = b.shape[0]
    kb = -(-k // SCALE_BLOCK)
    _check(n % WGRAD_N_MULTIPLE == 0 and n > 0,
           lambda: f"a: N must be a positive multiple of {WGRAD_N_MULTIPLE}, got {n}")
    _check(p % MN_MULTIPLE == 0 and p > 0, lambda: f"b: P must be a positive multiple of {MN_MULTIPLE}, got {p}")
    _check(k % MN_MULTIPLE == 0 and k > 0, lambda: f"a: K must be a positive multiple of {MN_MULTIPLE}, got {k}")
    _check(tuple(a_scale.shape) == (n, kb) and tuple(b_scale.shape) == (p, kb),
           lambda: f"a_scale, b_scale: expected shapes {(n, kb)} and {(p, kb)} (1x128 blocks), got "
           f"{tuple(a_scale.shape)} and {tuple(b_scale.shape)}")
    _check(a_scale.dtype == torch.float32 and b_scale.dtype == torch.float32,
           lambda: f"a_scale, b_scale: expected torch.float32, got {a_scale.dtype} and {b_scale.dtype}")
    _check(group_ends.dim() == 1 and group_ends.numel() > 0 and group_ends.dtype in (torch.int32, torch.int64),
           lambda: f"group_ends: expected a non-empty 1-D int32 tensor, got {group_ends.dtype} "
           f"{tuple(group_ends.shape)}")
    _check_out_dtype(out_dtype)
    _check_on_cuda_like_a(a, a_scale=a_scale, b=b, b_scale=b_scale, group_ends=group_ends)
    dev = a.device
    _check(a.stride(1) == 1 and b.stride(1) == 1 and a.stride(0) % 16 == 0 and b.stride(0) % 16 == 0
           and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0,
           "a, b: must be contiguous along K with 16-byte aligned rows")
    e = group_ends.numel()
    d = torch.empty((e, n, p), dtype=out_dtype, device=dev)
    num_sms = sm_count(dev)
    if config is None:
        config = _tile_config_cls()(tile_m=128 if n % 128 == 0 else 64,
                                    tile_n=min(_TILE_N_PER_COL_MAX, p) if p % 16 == 0 else 16)
    _check(n % config.tile_m == 0, lambda: f"config: tile_m={config.tile_m} must divide N={n}")
    _check_grouped_config(config, p, "P")
    fn = _get_compiled(config, out_dtype, 1, None, num_sms, _ARCH_DEFAULT, "kgrouped")
    ends = group_ends if group_ends.dtype == torch.int32 and group_ends.is_contiguous() \
        else group_ends.to(torch.int32).contiguous()
    _launch(fn, a, b, d.view(e * n, p), _tma_a_scale(a_scale), _prep_b_scale_per_col(b_scale), _unused_args(dev)[0],
            ends, n)
    return d


# ----------------------------------------------------------------------------- registered kernels
# The registry's implementations (``lowprec.gemm.sm90``): the reference's arguments,
# QuantizedTensors whose constraints ``config`` states.
def _blockwise_scales(a, b) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales as the kernel takes them: A [M, ceil(K/128)]; B [ceil(N/128) or N, ceil(K/128)].

    Rowwise and tensorwise scales are constant along K, so repeating them per 128-wide K block
    gives the same product: one kernel serves all FP8 recipes with FP32 scales.
    """
    m, k = a.shape
    n = b.shape[0]
    kb = -(-k // SCALE_BLOCK)
    sa = a.scale if a.recipe.name == "fp8_block1x128" else a.scale.reshape(-1, 1).expand(m, kb).contiguous()
    if b.recipe.name in ("fp8_block128x128", "fp8_block16x128", "fp8_block1x128"):
        sb = b.scale
    elif b.recipe.name == "fp8_rowwise":
        sb = b.scale.reshape(n, 1).expand(n, kb).contiguous()
    else:
        sb = b.scale.reshape(1, 1).expand(-(-n // SCALE_BLOCK), kb).contiguous()
    return sa, sb


def _k_major(data: torch.Tensor) -> torch.Tensor:
    """FP8 codes as the kernel reads them: K contiguous, rows 16-byte aligned (a copy otherwise).
    Under torch.compile the op gets the layouts inductor chose for the traced reference
    quantization (e.g. strides (1, M)); slices of wider tensors may be misaligned."""
    if data.stride(1) == 1 and (data.stride(0) % 16 == 0 or data.shape[0] == 1) and data.data_ptr() % 16 == 0:
        return data
    return data.clone(memory_format=torch.contiguous_format)  # a fresh buffer: aligned even where contiguous


# B's scale block rows by recipe as ``_blockwise_scales`` hands them over: sb [N, KB] one scale per
# column, [N / 16, KB] per 16; every other recipe [N / 128, KB]
_B_BLOCK_N_OF_RECIPE = {"fp8_block1x128": 1, "fp8_rowwise": 1, "fp8_block16x128": 16}


def gemm_quantized(a, b, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """``lowprec.gemm`` on this kernel: QuantizedTensors (their shapes, dtypes and devices checked
    when built) that ``config.gemm_unsupported`` accepted, so no second validation."""
    sa, sb = _blockwise_scales(a, b)
    b_block_n = _B_BLOCK_N_OF_RECIPE.get(b.recipe.name, SCALE_BLOCK)
    return _run_dense(_k_major(a.data), sa, _k_major(b.data), sb, out_dtype, bias, b_block_n)


def linear_inference(x, weight, weight_scale, weight_recipe: str, activation_recipe: str, bias,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """``FP8InferenceLinear``'s eager forward in one lean host pass: ``x`` [M, K] quantized in 1x128
    blocks by the quantize kernel (scales written in the layout the GEMM's TMA reads), then the dense
    kernel on the 128x128-block FP8 ``weight`` [N, K]: the kernels and bits of ``lowprec.gemm(
    lowprec.quantize(x, "fp8_block1x128"), weight)`` without their dispatch, QuantizedTensors and
    second validation (``config.linear_inference_unsupported`` holds)."""
    from ...quant.sm90.interface import quantize_1x128

    codes, scales = quantize_1x128(x)
    return _run_dense(codes, scales, _k_major(weight), weight_scale, out_dtype, bias, SCALE_BLOCK)


def grouped_gemm_quantized(a, b, out_dtype: torch.dtype, group_ends: torch.Tensor | None,
                           masked_counts: torch.Tensor | None) -> torch.Tensor:
    """``lowprec.grouped_gemm`` on this kernel."""
    return grouped_gemm_blockwise_fp8(a.data, a.scale, b.data, b.scale, group_ends=group_ends,
                                      masked_counts=masked_counts, out_dtype=out_dtype)


def grouped_gemm_wgrad_quantized(a, b, group_ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``lowprec.moe.grouped_gemm_wgrad`` on this kernel."""
    return grouped_gemm_wgrad_fp8(a.data, a.scale, b.data, b.scale, group_ends, out_dtype)
