"""Tests of the sm_90a grouped FP8 block-scaled GEMM (contiguous and masked layouts).

(a) compile tests (CPU, CI): the grouped configs compile for sm_90a; SASS has QGMMA and no
    local-memory spills.
(b) GPU tests (``-m gpu``): per group vs an fp64 matmul of the dequantized operands on skewed
    group sizes (0, 1, not multiples of 128, one group holding everything), rows outside the
    groups zero, outputs poisoned beforehand, determinism, CUDA-graph capture, public API.
"""

from __future__ import annotations

import pytest
import torch

from .test_sm90 import (
    HAS_CUTLASS,
    assert_close_bf16,
    assert_close_fp32,
    assert_wgmma_pipelined,
    dequant,
    gpu,
    needs_cutlass,
    needs_gpu,
    quant_1x128,
    quant_128x128,
    random_operand,
)

# (tile_m, tile_n, cluster_n): 1x2 clusters take two neighbouring N tiles of one M tile (A multicast)
KGROUPED_CONFIGS = [(128, 128, 1), (64, 128, 1), (128, 64, 1), (128, 128, 2), (64, 128, 2)]
# 192-wide tiles: no second block accumulator, one mainloop copy per scale-block split
GROUPED_CONFIGS = KGROUPED_CONFIGS + [(128, 192, 1), (128, 192, 2)]


def _cfg_id(t):
    return f"{t[0]}x{t[1]}_c1x{t[2]}"


def _config(t):
    from lowprec.gemm.sm90.config import TileConfig

    return TileConfig(tile_m=t[0], tile_n=t[1], cluster_n=t[2])


@needs_cutlass
@pytest.mark.parametrize("grouping", ["contiguous", "masked"])
@pytest.mark.parametrize("tile", GROUPED_CONFIGS, ids=_cfg_id)
def test_compile_grouped(grouping, tile):
    from lowprec.gemm.sm90.interface import compile_only
    from lowprec.runtime.compile import local_memory_ops, sass_of

    kernel = compile_only(_config(tile), grouping=grouping)
    sass = sass_of(kernel)
    assert "QGMMA" in sass
    assert_wgmma_pipelined(sass)
    assert local_memory_ops(sass) == 0
    assert ("UTMALDG.2D.MULTICAST" in sass) == (tile[2] > 1)


@pytest.mark.skipif(not HAS_CUTLASS, reason="nvidia-cutlass-dsl not installed")
def test_grouped_rejects_bad_options():
    import cutlass

    from lowprec.gemm.sm90.blockscaled_gemm import BlockScaledGemmSm90
    from lowprec.gemm.sm90.config import TileConfig

    with pytest.raises(ValueError, match="grouping"):
        BlockScaledGemmSm90(TileConfig(), cutlass.BFloat16, 128, None, 132, "ragged")
    with pytest.raises(ValueError, match="cluster"):
        BlockScaledGemmSm90(TileConfig(cluster_m=2), cutlass.BFloat16, 128, None, 132, "masked")
    with pytest.raises(ValueError, match="cluster"):
        BlockScaledGemmSm90(TileConfig(cluster_n=4), cutlass.BFloat16, 128, None, 132, "contiguous")


def test_choose_grouped_config():
    from lowprec.gemm.sm90.interface import choose_grouped_config

    assert choose_grouped_config(1024, 4096, 2048, 8).tile_m == 128
    assert choose_grouped_config(40, 4096, 2048, 64).tile_m == 64
    assert choose_grouped_config(16, 256, 2048, 2).tile_n == 64  # few tiles: narrower N tiles
    assert choose_grouped_config(1024, 96, 2048, 8).tile_n == 96
    # 192-wide tiles when there are enough; in pairs where clusters are wanted (K >= 4096)
    e8 = choose_grouped_config(1024, 28672, 4096, 8)
    assert (e8.tile_n, e8.cluster_n) == (192, 2)
    e128 = choose_grouped_config(512, 1536, 2048, 128)
    assert (e128.tile_n, e128.cluster_n) == (192, 1)
    odd = choose_grouped_config(1024, 2112, 7168, 8)  # 11 tiles of 192, 17 of 128
    assert (odd.tile_n, odd.cluster_n) == (128, 1)
    assert choose_grouped_config(1024, 384, 7168, 8).tile_n == 128  # 64 x 2 tiles of 192: fewer than the SMs
    assert choose_grouped_config(1024, 28672, 2048, 8).cluster_n == 1
    assert choose_grouped_config(1024, 384, 7168, 8).cluster_n == 1  # 3 N tiles


# ----------------------------------------------------------------------------- GPU
def _experts(e, n, k, gen):
    qs, ss, deq = [], [], []
    for _ in range(e):
        q, s = quant_128x128(random_operand(n, k, "cuda", gen))
        qs.append(q)
        ss.append(s)
        deq.append(dequant(q, s, 128))
    return torch.stack(qs), torch.stack(ss), deq


def _poison_next_alloc(shape, dtype):
    """Leave NaN-filled memory in the allocator's cache for the next tensor of this size."""
    t = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    del t


def _run_contiguous(sizes, n, k, out_dtype=torch.bfloat16, config=None, spare_rows=0, seed=0):
    from lowprec.gemm.sm90.interface import grouped_gemm_blockwise_fp8

    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    e = len(sizes)
    m = sum(sizes) + spare_rows
    a, sa = quant_1x128(random_operand(m, k, "cuda", gen))
    b, sb, b_deq = _experts(e, n, k, gen)
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    _poison_next_alloc((m, n), out_dtype)
    d = grouped_gemm_blockwise_fp8(a, sa, b, sb, group_ends=ends, out_dtype=out_dtype, config=config)
    a_deq = dequant(a, sa, 1)
    start = 0
    for g, size in enumerate(sizes):
        if size:
            ref = a_deq[start:start + size] @ b_deq[g].T
            (assert_close_bf16 if out_dtype == torch.bfloat16 else assert_close_fp32)(d[start:start + size], ref)
        start += size
    assert torch.all(d[start:] == 0), "rows after the last group must be zero"
    return a, sa, b, sb, ends, d


SKEWED = {
    "mixed": [0, 1, 127, 128, 129, 300, 0, 513],
    "one_group_all": [0, 0, 700, 0],
    "single_row": [0, 1, 0],
    "empty_tail": [256, 0, 0, 0],
    "many_small": [3, 17, 64, 65, 0, 9, 31, 100, 1, 2, 5, 77, 128, 0, 200, 40],
    # partial last tiles with 64 rows or fewer and with more
    "tails": [192, 64, 65, 191, 320, 129, 256, 1, 448],
}


@gpu
@needs_gpu
@pytest.mark.parametrize("case", list(SKEWED))
def test_contiguous_skewed(case):
    _run_contiguous(SKEWED[case], n=384, k=640, spare_rows=37)


@gpu
@needs_gpu
@pytest.mark.parametrize("tile", GROUPED_CONFIGS, ids=_cfg_id)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_contiguous_configs(tile, out_dtype):
    # 2112 = 16.5 x 128: a partial last N tile; clusters need an even N tile count;
    # 2240 = 11.7 x 192: tiles start 0 and 64 columns into a scale block (both loop copies)
    n = 2240 if tile[1] == 192 else 2112 if tile[2] == 1 else 2048
    _run_contiguous(SKEWED["mixed"], n=n, k=1536, out_dtype=out_dtype, config=_config(tile), spare_rows=5)


@gpu
@needs_gpu
@pytest.mark.parametrize("case", list(SKEWED))
def test_contiguous_skewed_cluster(case):
    """1x2 clusters on every skewed routing, bit-identical to 1x1 (same K order per element)."""
    from lowprec.gemm.sm90.interface import grouped_gemm_blockwise_fp8

    a, sa, b, sb, ends, d = _run_contiguous(SKEWED[case], n=512, k=640, spare_rows=37,
                                            config=_config((128, 128, 2)))
    single = grouped_gemm_blockwise_fp8(a, sa, b, sb, group_ends=ends, config=_config((128, 128, 1)))
    assert torch.equal(d, single)


@gpu
@needs_gpu
@pytest.mark.parametrize("tile", [(128, 128, 1), (128, 192, 2)], ids=_cfg_id)
def test_contiguous_tails_bit_identical_to_64_row_tiles(tile):
    """A group's partial last tile is moved back to end at the group's end, so its first rows
    are computed twice: every element keeps its K order either way, so the output equals the
    64-row-tile config's bit for bit (there, tiles of a group never overlap)."""
    from lowprec.gemm.sm90.interface import grouped_gemm_blockwise_fp8

    a, sa, b, sb, ends, d = _run_contiguous(SKEWED["tails"], n=2240 if tile[1] == 192 else 2048, k=640,
                                            spare_rows=3, config=_config(tile))
    narrow = grouped_gemm_blockwise_fp8(a, sa, b, sb, group_ends=ends, config=_config((64, 128, 1)))
    assert torch.equal(d, narrow)


@gpu
@needs_gpu
def test_contiguous_deterministic_and_graph():
    from lowprec.gemm.sm90.interface import grouped_gemm_blockwise_fp8

    a, sa, b, sb, ends, d = _run_contiguous(SKEWED["mixed"], n=256, k=512)
    again = grouped_gemm_blockwise_fp8(a, sa, b, sb, group_ends=ends)
    assert torch.equal(d, again)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = grouped_gemm_blockwise_fp8(a, sa, b, sb, group_ends=ends)
    # new routing, same buffers: the graph reads the group ends on the device
    ends.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 0, ends[-1].item()], device="cuda", dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    a_deq = dequant(a, sa, 1)
    assert_close_bf16(captured, a_deq @ dequant(b[-1], sb[-1], 128).T)


@gpu
@needs_gpu
@pytest.mark.parametrize("m_max,counts", [(200, [0, 1, 130, 200]), (64, [64, 0, 7, 33]), (1, [1, 0])])
@pytest.mark.parametrize("tile", [(128, 128, 1), (128, 128, 2), (128, 192, 2)], ids=_cfg_id)
def test_masked(m_max, counts, tile):
    from lowprec.gemm.sm90.interface import grouped_gemm_blockwise_fp8

    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    e, n, k = len(counts), 256, 768
    a, sa = quant_1x128(random_operand(e * m_max, k, "cuda", gen))
    b, sb, b_deq = _experts(e, n, k, gen)
    cnt = torch.tensor(counts, dtype=torch.int32, device="cuda")
    _poison_next_alloc((e, m_max, n), torch.bfloat16)
    d = grouped_gemm_blockwise_fp8(a.view(e, m_max, k), sa.view(e, m_max, -1), b, sb, masked_counts=cnt,
                                   config=_config(tile))
    a_deq = dequant(a, sa, 1).view(e, m_max, k)
    for g, c in enumerate(counts):
        if c:
            assert_close_bf16(d[g, :c], a_deq[g, :c] @ b_deq[g].T)
        assert torch.all(d[g, c:] == 0), f"group {g}: rows past its count must be zero"


@gpu
@needs_gpu
def test_public_api_matches_reference(monkeypatch):
    import lowprec
    from lowprec.gemm.reference import grouped_gemm_contiguous_reference

    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")  # a kernel failure must fail the test

    gen = torch.Generator(device="cuda")
    gen.manual_seed(2)
    sizes = [5, 0, 200, 131]
    x = random_operand(sum(sizes) + 3, 512, "cuda", gen)
    w = torch.stack([random_operand(256, 512, "cuda", gen) for _ in sizes])
    xq = lowprec.quantize(x, "fp8_block1x128")
    wq = lowprec.quantize(w, "fp8_block128x128")
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    d = lowprec.grouped_gemm(xq, wq, group_ends=ends)
    ref = grouped_gemm_contiguous_reference(xq, wq, ends, torch.float64, torch.float64)
    assert_close_bf16(d, ref)


# ----------------------------------------------------------------------------- K-grouped (wgrad)
@needs_cutlass
@pytest.mark.parametrize("tile", KGROUPED_CONFIGS, ids=_cfg_id)
def test_compile_kgrouped(tile):
    from lowprec.gemm.sm90.interface import compile_only
    from lowprec.runtime.compile import local_memory_ops, sass_of

    kernel = compile_only(_config(tile), out_dtype=torch.float32, b_block_n=1, grouping="kgrouped")
    sass = sass_of(kernel)
    assert "QGMMA" in sass
    assert_wgmma_pipelined(sass)
    assert local_memory_ops(sass) == 0


@gpu
@needs_gpu
@pytest.mark.parametrize("sizes", [[0, 1, 127, 128, 129, 300, 0, 513], [0, 0, 700, 0], [5]],
                         ids=["mixed", "one_group", "single"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_kgrouped_wgrad(sizes, out_dtype, monkeypatch):
    from lowprec.moe.wgrad import grouped_gemm_wgrad, quantize_k_grouped

    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")  # a kernel failure must fail the test

    gen = torch.Generator(device="cuda")
    gen.manual_seed(3)
    rows = sum(sizes) + 11
    dy = random_operand(rows, 256, "cuda", gen)
    x = random_operand(rows, 384, "cuda", gen)
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    dy_t, aligned = quantize_k_grouped(dy, ends)
    x_t, _ = quantize_k_grouped(x, ends)
    _poison_next_alloc((len(sizes), 256, 384), out_dtype)
    dw = grouped_gemm_wgrad(dy_t, x_t, aligned, out_dtype)
    a_deq, b_deq = dy_t.dequantize(torch.float64), x_t.dequantize(torch.float64)
    start = 0
    for g, end in enumerate(aligned.tolist()):
        if end > start:
            ref = a_deq[:, start:end] @ b_deq[:, start:end].T
            (assert_close_bf16 if out_dtype == torch.bfloat16 else assert_close_fp32)(dw[g], ref)
        else:
            assert torch.all(dw[g] == 0), f"group {g} is empty: its gradient must be zero"
        start = end
    # 1x2 clusters (6 N tiles of 64) give the same bits as single CTAs with the same tiles
    from lowprec.gemm.sm90.interface import grouped_gemm_wgrad_fp8

    args = (dy_t.data, dy_t.scale, x_t.data, x_t.scale, aligned, out_dtype)
    single = grouped_gemm_wgrad_fp8(*args, config=_config((128, 64, 1)))
    assert torch.equal(grouped_gemm_wgrad_fp8(*args, config=_config((128, 64, 2))), single)


# ----------------------------------------------------------------------------- argument errors (CPU)
def _f8(*shape):
    return torch.zeros(*shape, dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("case,match", [
    ("b_2d", "b: expected \\[E, N, K\\]"),
    ("a_k", "a: expected \\[M, K=256\\]"),
    ("a_scale", "a_scale: expected shape"),
    ("b_scale", "b_scale: expected shape"),
    ("group", "group: expected an int32 or int64 tensor of shape \\(2,\\)"),
    ("out_dtype", "out_dtype"),
    ("both", "exactly one of"),
    ("cpu", "a: expected a CUDA tensor"),
])
def test_grouped_argument_errors(case, match):
    from lowprec.gemm.sm90.interface import grouped_gemm_blockwise_fp8

    a, sa = _f8(300, 256), torch.ones(300, 2)
    b, sb = _f8(2, 128, 256), torch.ones(2, 1, 2)
    kw = {"group_ends": torch.tensor([100, 300], dtype=torch.int32)}
    if case == "b_2d":
        b = _f8(128, 256)
    elif case == "a_k":
        a = _f8(300, 128)
    elif case == "a_scale":
        sa = torch.ones(300, 3)
    elif case == "b_scale":
        sb = torch.ones(2, 2, 2)
    elif case == "group":
        kw = {"group_ends": torch.tensor([300], dtype=torch.int32)}
    elif case == "out_dtype":
        kw["out_dtype"] = torch.int8
    elif case == "both":
        kw["masked_counts"] = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        grouped_gemm_blockwise_fp8(a, sa, b, sb, **kw)


@pytest.mark.parametrize("cfg,match", [
    ((128, 128, 2), "cluster_n=2 must divide the 3 N tiles of N=384"),
    ("split", "grouped GEMMs take cluster_m=1 and split_k=1"),
])
def test_grouped_config_errors(cfg, match):
    from lowprec.gemm.sm90.config import TileConfig
    from lowprec.gemm.sm90.interface import _check_grouped_config

    config = TileConfig(split_k=2) if cfg == "split" else _config(cfg)
    with pytest.raises(ValueError, match=match):
        _check_grouped_config(config, 384, "N")
    _check_grouped_config(_config((128, 128, 2)), 512, "N")


def test_masked_argument_errors():
    from lowprec.gemm.sm90.interface import grouped_gemm_blockwise_fp8

    counts = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="a: expected \\[E=2, M_max, K=256\\]"):
        grouped_gemm_blockwise_fp8(_f8(3, 64, 256), torch.ones(3, 64, 2), _f8(2, 128, 256), torch.ones(2, 1, 2),
                                   masked_counts=counts)


@pytest.mark.parametrize("case,match", [
    ("n64", "a: N must be a positive multiple of 64"),
    ("p16", "b: P must be a positive multiple of 16"),
    ("scales", "a_scale, b_scale: expected shapes"),
    ("ends", "group_ends: expected a non-empty 1-D int32 tensor"),
])
def test_wgrad_argument_errors(case, match):
    from lowprec.gemm.sm90.interface import grouped_gemm_wgrad_fp8

    a, sa, b, sb = _f8(128, 512), torch.ones(128, 4), _f8(96, 512), torch.ones(96, 4)
    ends = torch.tensor([256, 512], dtype=torch.int32)
    if case == "n64":
        a, sa = _f8(96, 512), torch.ones(96, 4)
    elif case == "p16":
        b, sb = _f8(40, 512), torch.ones(40, 4)
    elif case == "scales":
        sb = torch.ones(96, 3)
    elif case == "ends":
        ends = torch.zeros(0, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        grouped_gemm_wgrad_fp8(a, sa, b, sb, ends)


def _zeros_q(shape, recipe):
    import lowprec

    return lowprec.quantize(torch.zeros(*shape), recipe)


def test_grouped_and_wgrad_constraints_refuse_empty_dimensions():
    """0 passes % 16, but the launchers refuse empty N, K, E (E = 0 divided by zero): the registry
    warned 'kernel failed' and fell back instead of taking the reference at once."""
    from lowprec.gemm.sm90 import config

    ends = torch.tensor([32, 64], dtype=torch.int32)
    a, w = _zeros_q((64, 256), "fp8_block1x128"), _zeros_q((2, 128, 256), "fp8_block128x128")
    assert config.grouped_unsupported(a, _zeros_q((2, 0, 256), "fp8_block128x128"), torch.bfloat16, ends, None)
    assert config.grouped_unsupported(_zeros_q((64, 0), "fp8_block1x128"), _zeros_q((2, 128, 0), "fp8_block128x128"),
                                      torch.bfloat16, ends, None)
    assert config.grouped_unsupported(a, _zeros_q((0, 128, 256), "fp8_block128x128"), torch.bfloat16,
                                      torch.zeros(0, dtype=torch.int32), None)
    assert config.grouped_unsupported(a, w, torch.bfloat16, ends, None) is None
    ends = torch.tensor([128, 256], dtype=torch.int32)
    b = _zeros_q((32, 256), "fp8_block1x128")
    assert config.wgrad_unsupported(_zeros_q((0, 256), "fp8_block1x128"), b, ends, torch.float32)
    assert config.wgrad_unsupported(a, _zeros_q((0, 256), "fp8_block1x128"), ends, torch.float32)
    assert config.wgrad_unsupported(_zeros_q((64, 0), "fp8_block1x128"), _zeros_q((32, 0), "fp8_block1x128"),
                                    torch.zeros(1, dtype=torch.int32), torch.float32)
    assert config.wgrad_unsupported(a, b, torch.zeros(0, dtype=torch.int32), torch.float32)
    assert config.wgrad_unsupported(a, b, ends, torch.float32) is None
