"""Tests of the sm_90a FP8 block-scaled GEMM (lowprec.gemm.sm90).

(a) compile tests (CPU, CI): every shipped tile config compiles for sm_90a; its SASS has QGMMA
    and no local-memory spills (LDL/STL).
(b) GPU tests (``-m gpu``, skipped without CUDA): kernel vs an fp64 matmul of the dequantized
    operands, fresh random data with outliers, poisoned outputs, determinism.
"""

from __future__ import annotations

import pytest
import torch

from lowprec.gemm.sm90 import config as sm90_config
from lowprec.gemm.sm90 import interface as sm90_interface

from ..hopper import HAS_CUTLASS, gpu, needs_cutlass, needs_gpu

F8 = torch.float8_e4m3fn
F8_MAX = 448.0


# ----------------------------------------------------------------------------- local quantizer
def quant_1x128(x: torch.Tensor):
    """x [R, K] -> (q fp8 [R, K], s fp32 [R, ceil(K/128)]), s = amax/448 per 1x128 block."""
    r, k = x.shape
    kb = -(-k // 128)
    xp = torch.zeros(r, kb * 128, dtype=torch.float32, device=x.device)
    xp[:, :k] = x
    blocks = xp.view(r, kb, 128)
    amax = blocks.abs().amax(dim=-1)
    s = torch.where(amax > 0, amax / F8_MAX, torch.ones_like(amax))
    q = (blocks / s[..., None]).clamp(-F8_MAX, F8_MAX).to(F8).view(r, kb * 128)[:, :k]
    return q.contiguous(), s


def quant_128x128(w: torch.Tensor, rows: int = 128):
    """w [N, K] -> (q fp8 [N, K], s fp32 [ceil(N/rows), ceil(K/128)]): blocks of rows x 128."""
    n, k = w.shape
    nb, kb = -(-n // rows), -(-k // 128)
    wp = torch.zeros(nb * rows, kb * 128, dtype=torch.float32, device=w.device)
    wp[:n, :k] = w
    blocks = wp.view(nb, rows, kb, 128)
    amax = blocks.abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / F8_MAX, torch.ones_like(amax))
    q = (blocks / s[:, None, :, None]).clamp(-F8_MAX, F8_MAX).to(F8)
    q = q.view(nb * rows, kb * 128)[:n, :k]
    return q.contiguous(), s


def dequant(q: torch.Tensor, s: torch.Tensor, block_rows: int) -> torch.Tensor:
    r, k = q.shape
    s_full = s.double().repeat_interleave(block_rows, 0)[:r].repeat_interleave(128, 1)[:, :k]
    return q.double() * s_full


def random_operand(r, k, device, gen):
    x = torch.randn(r, k, device=device, generator=gen)
    # outliers: ~0.1% of the entries 100x larger, and some rows/blocks with a different range
    mask = torch.rand(r, k, device=device, generator=gen) < 1e-3
    x = torch.where(mask, x * 100.0, x)
    x = x * torch.exp(torch.randn(r, 1, device=device, generator=gen))
    return x


def make_problem(m, n, k, b_kind, device="cuda", seed=None):
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else torch.seed() % (2**31))
    a, sa = quant_1x128(random_operand(m, k, device, gen))
    w = random_operand(n, k, device, gen)
    if b_kind in ("block", "col16"):  # 128x128 (weights) or 16x128 blocks
        b_rows = 128 if b_kind == "block" else 16
        b, sb = quant_128x128(w, b_rows)
    else:
        b, sb = quant_1x128(w)
        b_rows = 1
    ref = dequant(a, sa, 1) @ dequant(b, sb, b_rows).T
    return a, sa, b, sb, ref


def rel_err(d: torch.Tensor, ref: torch.Tensor) -> float:
    return ((d.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


# Tolerances. bf16 out: 2e-3, or 1.1x the error of the fp64 reference merely rounded to bf16 plus
# 1e-3 (with outliers a single-row output can have a rounding floor above 2e-3).
# fp32 out: Hopper's FP8 wgmma adds products inside one instruction with ~14 effective mantissa
# bits (DeepSeek-V3 report), and promotion happens per 128-wide K block, so the measured error of
# a correct kernel is ~1.5e-4..3e-4 (H100, these inputs); 1e-5 is not reachable with FP8 tensor
# cores. A scale or indexing bug gives errors of 1e-2 and more.
BF16_TOL = 2e-3
FP32_TOL = 6e-4


def assert_close_bf16(d, ref):
    err = rel_err(d, ref)
    floor = rel_err(ref.to(torch.bfloat16), ref)
    # + the FP8-wgmma accumulation error (single rows with 100x outliers reach ~1e-3)
    tol = max(BF16_TOL, 1.1 * floor + 1e-3)
    assert err <= tol, f"rel err {err:.3e} (bf16 rounding floor {floor:.3e}, tol {tol:.3e})"


def assert_close_fp32(d, ref):
    err = rel_err(d, ref)
    assert err <= FP32_TOL, f"rel err {err:.3e}"


# ----------------------------------------------------------------------------- (a) compile tests
def _shipped():
    from lowprec.gemm.sm90.interface import _shipped_configs

    return _shipped_configs() if HAS_CUTLASS else ()


def assert_wgmma_pipelined(sass: str):
    """ptxas serializes every wgmma (C7514: an ARRIVE / DEPBAR pair around each QGMMA) when it
    sees accumulator registers touched while a batch is in flight; a pipelined kernel has one
    ARRIVE per batch of 4 QGMMA (one 128-wide K block)."""
    qgmma, arrive = sass.count("QGMMA"), sass.count("WARPGROUP.ARRIVE")
    assert 2 * arrive <= qgmma, f"wgmma serialized: {arrive} WARPGROUP.ARRIVE for {qgmma} QGMMA"


def _check_sass(compiled):
    from lowprec.runtime.compile import local_memory_ops, nvdisasm_path, sass_of

    if nvdisasm_path() is None:
        pytest.skip("no nvdisasm available (pip install nvidia-cuda-nvdisasm)")
    sass = sass_of(compiled)
    assert "QGMMA" in sass, "no QGMMA (FP8 wgmma) in the SASS"
    assert_wgmma_pipelined(sass)
    assert "ACQBULK" in sass, "no griddepcontrol.wait: programmatic dependent launch is unsafe"
    spills = local_memory_ops(sass)
    assert not spills, f"local-memory traffic in SASS: {spills} LDL/STL"


@needs_cutlass
@pytest.mark.parametrize("config", _shipped(), ids=str)
def test_compile_shipped_config(config):
    from lowprec.gemm.sm90.interface import compile_only

    _check_sass(compile_only(config, arch="sm_90a"))


@needs_cutlass
@pytest.mark.parametrize(
    "out_dtype,per_col,bias_dtype,tile_n",
    [
        (torch.float32, False, None, 128),
        (torch.bfloat16, True, None, 128),
        (torch.bfloat16, True, torch.float32, 112),
        (torch.bfloat16, False, torch.bfloat16, 160),
        (torch.float32, True, torch.bfloat16, 64),
    ],
)
def test_compile_variants(out_dtype, per_col, bias_dtype, tile_n):
    from lowprec.gemm.sm90.blockscaled_gemm import TileConfig
    from lowprec.gemm.sm90.interface import compile_only

    cfg = TileConfig(tile_m=128, tile_n=tile_n)
    _check_sass(compile_only(cfg, out_dtype=out_dtype, b_block_n=1 if per_col else 128, bias_dtype=bias_dtype))


@needs_cutlass
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_compile_per_col_bias_at_large_m(bias_dtype):
    """1x128 B scales with a bias in the configs the heuristic picks at large M: 2x1 clusters of
    128x128 below M = 4096, two-wave 256x112 tiles in 1x2 clusters from there."""
    from lowprec.gemm.sm90.interface import choose_config, compile_only

    cfg = choose_config(2048, 4096, 16384, b_block_n=1)
    assert cfg.cluster_m == 2, cfg
    _check_sass(compile_only(cfg, out_dtype=torch.bfloat16, b_block_n=1, bias_dtype=bias_dtype))
    cfg = choose_config(8192, 4096, 16384, b_block_n=1)
    assert (cfg.tile_m, cfg.tile_n, cfg.cluster_n) == (256, 112, 2), cfg
    _check_sass(compile_only(cfg, out_dtype=torch.bfloat16, b_block_n=1, bias_dtype=bias_dtype))


@needs_cutlass
@pytest.mark.parametrize(
    "name,out_dtype,bias_dtype",
    [
        ("256x128_c2x1_m1", torch.float32, torch.float32),  # fp32 out: a barrier pair per slice
        ("256x96_c1x1_m1", torch.bfloat16, torch.bfloat16),  # tiles straddling two scale blocks
        ("256x64_c1x2_n4", torch.bfloat16, None),
    ],
)
def test_compile_two_wave_tiles(name, out_dtype, bias_dtype):
    """256-row tiles (two 128-row waves) beyond the shipped 256x128: every epilogue and scale
    path compiles pipelined, without local memory."""
    from lowprec.gemm.sm90.interface import compile_only
    from lowprec.gemm.sm90.tune import parse_config

    _check_sass(compile_only(parse_config(name), out_dtype=out_dtype, bias_dtype=bias_dtype))


@needs_cutlass
@pytest.mark.parametrize(
    "name,out_dtype,bias_dtype",
    [
        ("256x112_c1x2_n8", torch.bfloat16, None),
        ("256x112_c1x2_n8", torch.float32, torch.float32),  # fp32 out: a barrier pair per slice
        ("256x112_c2x1_m1", torch.bfloat16, torch.bfloat16),
        ("256x96_c1x2_n8", torch.float32, None),
    ],
)
def test_compile_two_wave_tiles_per_col(name, out_dtype, bias_dtype):
    """256-row tiles with 1x128 B scales (the weight-gradient kind; the column scales read once
    per K block for both waves): up to 112 wide they fit the 240 registers without local memory."""
    from lowprec.gemm.sm90.interface import compile_only
    from lowprec.gemm.sm90.tune import parse_config

    _check_sass(compile_only(parse_config(name), out_dtype=out_dtype, b_block_n=1, bias_dtype=bias_dtype))


@needs_cutlass
@needs_cutlass
@pytest.mark.parametrize("name,out_dtype,bias_dtype", [
    ("256x112_c1x2_n8", torch.bfloat16, None),
    ("256x128_c1x2_n8", torch.float32, torch.bfloat16),
    ("128x128_c2x1_n4", torch.bfloat16, None),
    ("64x48_c1x1_m1", torch.bfloat16, torch.float32),
    ("64x128_c2x1_m1", torch.bfloat16, None),  # group scales read from the stage at promotion
    ("64x64_c1x1_m1_s4", torch.float32, None),
])
def test_compile_col16(name, out_dtype, bias_dtype):
    """16x128 B blocks (the weight gradients of ``fp8_block_wgrad16``) on the per-column kind's
    tiles: pipelined, no local memory (every tile ``choose_config`` picks for them over a spread of
    shapes was checked the same way in session 45)."""
    from lowprec.gemm.sm90.interface import compile_only
    from lowprec.gemm.sm90.tune import parse_config

    _check_sass(compile_only(parse_config(name), out_dtype=out_dtype, b_block_n=16, bias_dtype=bias_dtype))


@needs_cutlass
def test_col16_rejects_tiles_it_cannot_split():
    from lowprec.gemm.sm90.interface import compile_only
    from lowprec.gemm.sm90.tune import parse_config

    with pytest.raises(ValueError, match="b_block_n 32"):
        compile_only(parse_config("128x80_c1x1_m1"), b_block_n=32)
    with pytest.raises(ValueError, match="b_block_n 16"):
        compile_only(parse_config("128x128_c1x1_m1"), b_block_n=16, grouping="contiguous")
    with pytest.raises(ValueError, match="b_block_n 12"):
        compile_only(parse_config("128x96_c1x1_m1"), b_block_n=12)


def test_two_wave_tiles_reject_what_they_do_not_support():
    from lowprec.gemm.sm90.interface import compile_only
    from lowprec.gemm.sm90.tune import parse_config

    for name, per_col in (("256x192_c1x1_m1", False), ("256x128_c1x1_m1_s2", True), ("256x128_c1x1_m1_s2", False)):
        with pytest.raises(ValueError, match="tile_m=256"):
            compile_only(parse_config(name), b_block_n=1 if per_col else 128)


def test_tune_parses_every_config_name():
    import dataclasses

    from lowprec.gemm.sm90.interface import _shipped_configs
    from lowprec.gemm.sm90.tune import parse_config

    for cfg in _shipped_configs():
        for c in (cfg, dataclasses.replace(cfg, pdl=False)):
            assert parse_config(str(c)) == c
    with pytest.raises(ValueError, match="expected e.g."):
        parse_config("128x128")


def test_heuristic_picks_shipped_configs():
    from lowprec.gemm.sm90.interface import _shipped_configs, choose_config

    if not HAS_CUTLASS:
        pytest.skip("nvidia-cutlass-dsl not installed")
    shipped = set(_shipped_configs())
    for m in (1, 7, 64, 128, 1000, 4096, 8192):
        for n, k in ((2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168),
                     (7168, 2048), (128, 512), (16, 16), (8192, 8192)):
            for per_col in (False, True):
                cfg = choose_config(m, n, k, 1 if per_col else 128)
                assert cfg in shipped, (m, n, k, per_col, cfg)
                assert cfg == choose_config(m, n, k, 1 if per_col else 128)


def test_heuristic_wide_tiles_follow_the_sweeps():
    """The large-M picks of NOTES session 24: 128x192 where it needs fewer waves (N = 2112),
    256x128 from K = 1536 up, 128x128 at K = 512; 1x128 B scales: 256x112 from M = 4096 (session 36)."""
    from lowprec.gemm.sm90.interface import choose_config

    picks = {(4096, 2112, 7168): (128, 192), (4096, 24576, 1536): (256, 128), (4096, 32768, 512): (128, 128),
             (4096, 7168, 16384): (256, 128), (4096, 4096, 7168): (256, 128), (8192, 8192, 8192): (256, 128)}
    for (m, n, k), tile in picks.items():
        cfg = choose_config(m, n, k)
        assert (cfg.tile_m, cfg.tile_n) == tile and cfg.cluster_n == 2, (m, n, k, cfg)
    assert choose_config(4096, 7168, 16384, b_block_n=1).tile_m == 256
    assert choose_config(1024, 7168, 16384, b_block_n=1).tile_m == 128
    # 16x128 B blocks: the block kind's large-M tiles (NOTES session 45)
    for m, n in ((4096, 4096), (14336, 4096), (4096, 14336)):
        cfg = choose_config(m, n, 8192, b_block_n=16)
        assert (cfg.tile_m, cfg.tile_n, cfg.cluster_n) == (256, 128, 2), cfg


def test_validation_errors_name_the_argument():
    from lowprec.gemm.sm90.interface import _validate

    a = torch.zeros(4, 128, dtype=F8)
    sa = torch.ones(4, 1)
    b = torch.zeros(32, 128, dtype=F8)
    sb = torch.ones(1, 1)
    with pytest.raises(ValueError, match="a:"):
        _validate(a.float(), sa, b, sb, torch.bfloat16, None)
    with pytest.raises(ValueError, match="b_scale"):
        _validate(a, sa, b, torch.ones(2, 1), torch.bfloat16, None)
    with pytest.raises(ValueError, match="a_scale"):
        _validate(a, torch.ones(4, 2), b, sb, torch.bfloat16, None)
    with pytest.raises(ValueError, match="N must be"):
        _validate(a, sa, torch.zeros(24, 128, dtype=F8), sb, torch.bfloat16, None)
    with pytest.raises(ValueError, match="bias"):
        _validate(a, sa, b, sb, torch.bfloat16, torch.ones(31))
    with pytest.raises(ValueError, match="out_dtype"):
        _validate(a, sa, b, sb, torch.int8, None)
    with pytest.raises(ValueError, match=r"b_scale: expected shape \[2, 1\] \(16x128"):
        _validate(a, sa, b, sb, torch.bfloat16, None, b_block_n=16)
    with pytest.raises(ValueError, match="b_block_n"):
        _validate(a, sa, b, sb, torch.bfloat16, None, b_block_n=8)


# ----------------------------------------------------------------------------- (b) GPU tests
SHAPES = [
    # (M, N, K)
    (1, 2112, 7168),
    (7, 128, 512),
    (64, 7168, 1536),
    (100, 2112, 7168),  # two 64-row tiles in one cluster, the second partial
    (128, 24576, 512),
    (1000, 2112, 1536),
    (4096, 7168, 512),
    (4096, 128, 16384),
    (128, 7168, 16384),
    (1000, 24576, 1536),
    (4096, 2112, 7168),
    (7, 2112, 528),  # K not a multiple of 128: partial last K block
    (130, 400, 272),  # odd everything
]


def _run(a, sa, b, sb, out_dtype, bias=None, config=None, b_block_n=None):
    from lowprec.gemm.sm90.interface import gemm_blockwise_fp8

    m, n = a.shape[0], b.shape[0]
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device=a.device)
    d = gemm_blockwise_fp8(a, sa, b, sb, out_dtype=out_dtype, bias=bias, config=config, out=out, b_block_n=b_block_n)
    torch.cuda.synchronize()
    assert d.data_ptr() == out.data_ptr()
    assert not torch.isnan(d).any(), f"{torch.isnan(d).sum().item()} unwritten (NaN) outputs"
    return d


@gpu
@needs_gpu
@pytest.mark.parametrize("b_kind", ["block", "col", "col16"])
@pytest.mark.parametrize("m,n,k", SHAPES, ids=lambda v: str(v))
def test_gemm_bf16_vs_fp64(m, n, k, b_kind):
    a, sa, b, sb, ref = make_problem(m, n, k, b_kind)
    d = _run(a, sa, b, sb, torch.bfloat16, b_block_n=16 if b_kind == "col16" else None)
    assert_close_bf16(d, ref)


@gpu
@needs_gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_col16_bit_identical_to_per_col(out_dtype):
    """16x128 B blocks (one scale product per row and 16 columns) give the bits of the per-column
    kind fed the same scale repeated per column, on every tile shape the per-column kind takes
    (two-wave 256x112 and its clusters, overlapped 128-row tiles, 64-row tiles, split-K), with a
    bias and tails in M, N (a tile's last group box partly past N) and K."""
    from lowprec.gemm.sm90.blockscaled_gemm import TileConfig
    from lowprec.gemm.sm90.tune import parse_config

    m, n, k = 1000, 912, 4496
    a, sa, b, sb, ref = make_problem(m, n, k, "col16")
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    sb_cols = sb.repeat_interleave(16, 0)[:n].contiguous()
    base = _run(a, sa, b, sb_cols, out_dtype, bias=bias, config=TileConfig(tile_m=128, tile_n=128))
    (assert_close_fp32 if out_dtype == torch.float32 else assert_close_bf16)(base, ref + bias.double()[None, :])
    for cfg in (None, TileConfig(tile_m=128, tile_n=128), TileConfig(tile_m=128, tile_n=112),
                TileConfig(tile_m=64, tile_n=48), TileConfig(tile_m=64, tile_n=128), parse_config("64x96_c2x1_m1"),
                parse_config("256x112_c1x2_n8"), parse_config("256x112_c2x1_m1"),
                parse_config("256x128_c1x2_n8"), parse_config("128x128_c2x1_n4")):
        d = _run(a, sa, b, sb, out_dtype, bias=bias, config=cfg, b_block_n=16)
        assert torch.equal(d, base), f"{cfg}: bits differ from the per-column kind"
    split = _run(a[:64], sa[:64], b, sb, torch.float32, config=TileConfig(tile_m=64, tile_n=64, split_k=4),
                 b_block_n=16)
    assert torch.equal(split, _run(a[:64], sa[:64], b, sb_cols, torch.float32,
                                   config=TileConfig(tile_m=64, tile_n=64, split_k=4)))


@gpu
@needs_gpu
@pytest.mark.parametrize("b_kind", ["block", "col"])
@pytest.mark.parametrize("m,n,k", [(7, 2112, 528), (1000, 2112, 1536), (4096, 7168, 512), (64, 7168, 16384)],
                         ids=lambda v: str(v))
def test_gemm_fp32_out_vs_fp64(m, n, k, b_kind):
    a, sa, b, sb, ref = make_problem(m, n, k, b_kind)
    d = _run(a, sa, b, sb, torch.float32)
    assert_close_fp32(d, ref)


@gpu
@needs_gpu
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gemm_bias(bias_dtype, out_dtype):
    m, n, k = 300, 2112, 1536
    a, sa, b, sb, ref = make_problem(m, n, k, "block")
    bias = (torch.randn(n, device="cuda") * 10).to(bias_dtype)
    ref = ref + bias.double()[None, :]
    d = _run(a, sa, b, sb, out_dtype, bias=bias)
    (assert_close_bf16 if out_dtype == torch.bfloat16 else assert_close_fp32)(d, ref)


@gpu
@needs_gpu
def test_mn_major_scales_and_strided_inputs():
    from lowprec.gemm.sm90.interface import gemm_blockwise_fp8

    m, n, k = 257, 2112, 1536
    a, sa, b, sb, ref = make_problem(m, n, k, "col")
    sa_mn = torch.empty(sa.shape[1], (m + 3) // 4 * 4, device="cuda")[:, :m].T
    sa_mn.copy_(sa)
    sb_mn = sb.T.contiguous().T
    d = gemm_blockwise_fp8(a, sa_mn, b, sb_mn)
    assert_close_bf16(d, ref)


@gpu
@needs_gpu
def test_all_shipped_configs_correct():
    """Every config the heuristic can pick, forced on a shape with M/N/K tails."""
    from lowprec.gemm.sm90.interface import _shipped_configs

    for b_kind in ("block", "col"):
        a, sa, b, sb, ref = make_problem(200, 912, 400, b_kind)
        for cfg in _shipped_configs():
            if cfg.split_k > 1 or (b_kind == "col" and (cfg.tile_n > 128 or cfg.tile_m == 256)):
                continue  # split-K: test_split_k_configs; 1x128 B scales: 64/128-row tiles up to 128 wide
            d = _run(a, sa, b, sb, torch.float32, config=cfg)
            err = rel_err(d, ref)
            assert err <= FP32_TOL, f"{cfg} {b_kind}: rel err {err:.3e}"


@gpu
@needs_gpu
@pytest.mark.parametrize("b_kind", ["block", "col"])
def test_tall_m_heuristic_configs_with_tails(b_kind):
    """The configs picked at M >= 8192 (2-CTA clusters, swizzled rasters) on tile counts that are
    odd and no multiple of the swizzle: 65 M tiles, 34 N tiles, tails in M, N and K."""
    from lowprec.gemm.sm90.interface import choose_config

    m, n, k = 8192 + 72, 4096 + 144, 400
    cfg = choose_config(m, n, k, 1 if b_kind == "col" else 128)
    assert cfg.swizzle > 1 and cfg.cluster_m * cfg.cluster_n == 2, cfg
    a, sa, b, sb, ref = make_problem(m, n, k, b_kind)
    d = _run(a, sa, b, sb, torch.float32)
    assert rel_err(d, ref) <= FP32_TOL, cfg


@gpu
@needs_gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_wide_tiles_bit_identical_to_128x128(out_dtype):
    """256-row (two-wave) and 192-wide tiles keep each output's K-block order and promotion:
    the same bits as 128x128 tiles, with a bias, tails in M, N and K, and tile starts inside a
    128-wide scale block (96-wide tiles)."""
    from lowprec.gemm.sm90.blockscaled_gemm import TileConfig
    from lowprec.gemm.sm90.tune import parse_config

    m, n, k = 1000, 912, 4496
    a, sa, b, sb, ref = make_problem(m, n, k, "block")
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    base = _run(a, sa, b, sb, out_dtype, bias=bias, config=TileConfig(tile_m=128, tile_n=128))
    (assert_close_fp32 if out_dtype == torch.float32 else assert_close_bf16)(base, ref + bias.double()[None, :])
    for name in ("256x128_c1x2_n8", "256x128_c2x1_m4", "256x96_c1x1_m1", "256x64_c1x2_m1", "128x192_c1x2_m1"):
        d = _run(a, sa, b, sb, out_dtype, bias=bias, config=parse_config(name))
        assert torch.equal(d, base), f"{name}: bits differ from 128x128"


@gpu
@needs_gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_per_col_two_wave_tiles_bit_identical_to_128x128(out_dtype):
    """1x128 B scales on 256-row tiles (column scales read once per K block, kept for the second
    wave): the same bits as the 128x128 tiles, with a bias and tails in M, N and K."""
    from lowprec.gemm.sm90.blockscaled_gemm import TileConfig
    from lowprec.gemm.sm90.tune import parse_config

    m, n, k = 1000, 912, 4496
    a, sa, b, sb, ref = make_problem(m, n, k, "col")
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    base = _run(a, sa, b, sb, out_dtype, bias=bias, config=TileConfig(tile_m=128, tile_n=128))
    (assert_close_fp32 if out_dtype == torch.float32 else assert_close_bf16)(base, ref + bias.double()[None, :])
    for name in ("256x112_c1x2_n8", "256x112_c2x1_m1", "256x96_c1x2_n8", "256x64_c1x2_m1"):
        d = _run(a, sa, b, sb, out_dtype, bias=bias, config=parse_config(name))
        assert torch.equal(d, base), f"{name}: bits differ from 128x128"


@gpu
@needs_gpu
@pytest.mark.parametrize("k_blocks", [2, 7, 8])
def test_two_wave_tiles_every_ring_phase(k_blocks):
    """The 256-row K loop runs blocks one at a time up to the ring's wrap, then whole turns of
    the ring with constant stages, then the rest: with several tiles per CTA and K-block counts
    that are no multiple of the stage count, tiles start at every ring index. Same bits as
    128x128 tiles."""
    from lowprec.gemm.sm90.blockscaled_gemm import TileConfig
    from lowprec.gemm.sm90.tune import parse_config

    m, n, k = 4096, 2048 + 96, 128 * k_blocks - 48  # 16 x 17 tiles: 2-3 per CTA; a partial K block
    for b_kind, names in (("block", ("256x128_c1x2_n8", "256x128_c2x1_m1")), ("col", ("256x112_c1x2_n8",))):
        a, sa, b, sb, ref = make_problem(m, n, k, b_kind)
        base = _run(a, sa, b, sb, torch.bfloat16, config=TileConfig(tile_m=128, tile_n=128))
        assert_close_bf16(base, ref)
        for name in names:
            d = _run(a, sa, b, sb, torch.bfloat16, config=parse_config(name))
            assert torch.equal(d, base), f"{name} ({b_kind}): bits differ from 128x128"


@gpu
@needs_gpu
@pytest.mark.parametrize("b_kind", ["block", "col"])
def test_split_k_configs(b_kind):
    from lowprec.gemm.sm90.blockscaled_gemm import TileConfig

    m, n, k = 100, 912, 3600  # 29 K blocks: uneven splits, partial last block
    a, sa, b, sb, ref = make_problem(m, n, k, b_kind)
    bias = torch.randn(n, device="cuda")
    ref = ref + bias.double()[None, :]
    for cfg in (TileConfig(64, 64, split_k=2), TileConfig(64, 64, split_k=4),
                TileConfig(128, 64, split_k=8), TileConfig(128, 128, split_k=4)):
        d = _run(a, sa, b, sb, torch.float32, bias=bias, config=cfg)
        assert rel_err(d, ref) <= FP32_TOL, cfg
        d2 = _run(a, sa, b, sb, torch.float32, bias=bias, config=cfg)
        assert torch.equal(d, d2), f"{cfg}: not deterministic"


@gpu
@needs_gpu
@pytest.mark.parametrize("m,n,k", [(4096, 7168, 7168), (64, 2112, 7168)])
def test_deterministic(m, n, k):
    a, sa, b, sb, _ = make_problem(m, n, k, "block")
    d1 = _run(a, sa, b, sb, torch.bfloat16)
    d2 = _run(a, sa, b, sb, torch.bfloat16)
    assert torch.equal(d1.view(torch.int16), d2.view(torch.int16))


@gpu
@needs_gpu
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
def test_dependent_launch_chain(graphed):
    """Each GEMM reads what the kernels just before it wrote (programmatic dependent launch lets
    it start while they drain): a chain x -> quantize -> gemm -> quantize -> gemm ... with no
    synchronization in between, eager and as a replayed CUDA graph, every link checked."""
    from lowprec.gemm.sm90.interface import gemm_blockwise_fp8

    n, depth = 1024, 6
    gen = torch.Generator(device="cuda")
    gen.manual_seed(7)
    x0 = random_operand(256, n, "cuda", gen)
    ws = [quant_128x128(random_operand(n, n, "cuda", gen) / 32) for _ in range(depth)]

    def chain(x):
        links = []
        for b, sb in ws:
            a, sa = quant_1x128(x)
            x = gemm_blockwise_fp8(a, sa, b, sb)
            links.append((a, sa, x))
        return links

    if graphed:
        static_x = x0.clone()
        chain(static_x)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            links = chain(static_x)
        graph.replay()
    else:
        links = chain(x0)
    torch.cuda.synchronize()
    for (a, sa, d), (b, sb) in zip(links, ws):
        assert_close_bf16(d, dequant(a, sa, 1) @ dequant(b, sb, 128).T)

    # back-to-back writes to one buffer: the later GEMM's result must be what stays
    (a1, sa1, _), (a2, sa2, _) = links[:2]
    b, sb = ws[0]
    out = torch.empty(256, n, dtype=torch.bfloat16, device="cuda")
    expected = gemm_blockwise_fp8(a2, sa2, b, sb).clone()
    for _ in range(4):
        gemm_blockwise_fp8(a1, sa1, b, sb, out=out)
        gemm_blockwise_fp8(a2, sa2, b, sb, out=out)
    assert torch.equal(out, expected)


@gpu
@needs_gpu
def test_validation_rejects_cpu_tensors():
    from lowprec.gemm.sm90.interface import gemm_blockwise_fp8

    a = torch.zeros(4, 128, dtype=F8)
    with pytest.raises(ValueError, match="CUDA"):
        gemm_blockwise_fp8(a, torch.ones(4, 1), torch.zeros(32, 128, dtype=F8), torch.ones(1, 1))


def test_k_major_copies_only_what_the_kernel_cannot_read():
    """The QuantizedTensor path trusts shapes but not memory: K-major rows 16-byte aligned pass
    as they are, anything else (transposed, misaligned slices) becomes a contiguous copy."""
    from lowprec.gemm.sm90.interface import _k_major

    codes = torch.zeros(64, 160, dtype=torch.uint8)
    assert _k_major(codes) is codes
    assert _k_major(codes[:, :128]).data_ptr() == codes.data_ptr()  # row stride 160: aligned
    every_other = codes[::2]
    assert _k_major(every_other) is every_other  # row stride 320: the kernel reads it as it is
    shifted = codes.view(-1)[8:8 + 32 * 128].view(32, 128)  # contiguous but 8 bytes off
    for strided in (codes.t(), codes[:, 8:136], shifted):
        out = _k_major(strided)
        assert out.is_contiguous() and out.data_ptr() % 16 == 0 and torch.equal(out, strided)
    one_row = codes[3:4, 16:]
    assert _k_major(one_row).data_ptr() == one_row.data_ptr()  # M = 1: no row stride to align


def test_linear_inference_constraint_checks_the_weight_scale():
    """The one-pass inference kernel gives B's scale grid its own row count: a grid shorter than N's
    128-row blocks would be read past its end (zeros: silently zero columns). Refused, with a non-FP32 one."""
    from lowprec.gemm.sm90 import config

    def args(scale):
        x = torch.randn(4, 256, dtype=torch.bfloat16)
        w = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
        return x, w, scale, "fp8_block128x128", "fp8_block1x128", None, torch.bfloat16

    assert config.linear_inference_unsupported(*args(torch.ones(1, 2))) is not None  # N = 256 needs 2 rows
    assert config.linear_inference_unsupported(*args(torch.ones(2, 2, dtype=torch.float64))) is not None
    assert config.linear_inference_unsupported(*args(torch.ones(2, 2))) is None


def test_misaligned_bf16_bias_is_accepted_and_launched_aligned(monkeypatch):
    m, n, k = 16, 32, 128
    a = torch.zeros(m, k, dtype=torch.float8_e4m3fn)
    b = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    sa = torch.ones(m, 1)
    sb = torch.ones(1, 1)
    bias = torch.randn(n + 1, dtype=torch.bfloat16)[1:]  # an odd element offset: 2 bytes past alignment
    assert bias.data_ptr() % 4 == 2
    assert sm90_config._dense_unsupported(m, n, k, torch.bfloat16, bias) is None  # the registry lets it through

    seen = {}
    monkeypatch.setattr(sm90_interface, "sm_count", lambda dev: 132)
    monkeypatch.setattr(sm90_interface, "_get_compiled", lambda *args, **kw: "compiled")
    monkeypatch.setattr(sm90_interface, "_launch", lambda fn, a, b, d, sa, sb, bias_arg, group, m_max=0:
                        seen.setdefault("bias", bias_arg))
    sm90_interface._run_dense(a, sa, b, sb, torch.bfloat16, bias, 128)
    launched = seen["bias"]
    assert launched.stride(0) == 1 and launched.data_ptr() % 4 == 0  # what the compiled kernel declares
    assert torch.equal(launched, bias)


@gpu
@needs_gpu
def test_a_bf16_bias_view_at_an_odd_offset_runs_the_kernel(monkeypatch):
    """The kernel reads a 4-byte aligned bias: a bf16 view 2 bytes off runs it on an aligned copy."""
    import lowprec

    g = torch.Generator(device="cuda").manual_seed(0)
    a = lowprec.quantize(torch.randn(64, 256, device="cuda", generator=g), "fp8_block1x128")
    b = lowprec.quantize(torch.randn(128, 256, device="cuda", generator=g), "fp8_block128x128")
    bias = torch.randn(129, device="cuda", generator=g).to(torch.bfloat16)[1:]
    assert bias.data_ptr() % 4 == 2
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")  # the kernel or raise
    y = lowprec.gemm(a, b, torch.float32, bias=bias)
    # a bias read 2 bytes off (or not at all) moves the error to ~5e-2
    assert_close_fp32(y, a.dequantize(torch.float64) @ b.dequantize(torch.float64).T + bias.double())
