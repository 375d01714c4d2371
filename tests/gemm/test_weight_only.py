"""The weight-only NVFP4 GEMM: the packed layout and its decode (CPU, exact), the sm_90a kernel's
compile and SASS (CI), the kernel against the reference (GPU)."""

import pytest
import torch

from lowprec import quantize
from lowprec.formats import E4M3, decode, unpack_fp4
from lowprec.gemm.ops import weight_only
from lowprec.gemm.weight_only import (
    CHUNK_BYTES,
    SPLITS,
    PackedFP8,
    decoded_tile_emulated,
    grouped_weight_only_reference,
    pack_fp8,
    pack_nvfp4,
    pack_nvfp4_experts,
    unpack_codes_emulated,
    unpack_fp8_emulated,
    weight_only_reference,
)
from lowprec.nn import NVFP4InferenceLinear
from lowprec.recipes import get_recipe
from tests.hopper import gpu, needs_cutlass, needs_gpu


def _nvfp4(n: int, k: int, weight_2d: bool = False, device="cpu", zero_rows=(), zero_cols=()):
    w = torch.randn(n, k, device=device)
    w[list(zero_rows)] = 0  # whole rows: their blocks get zero scales
    w[:, list(zero_cols)] = 0
    return quantize(w, get_recipe("nvfp4", weight_2d=weight_2d))


def _exact_dequant(q, weight_2d: bool) -> torch.Tensor:
    """code * scale * global in float64 (every product exact)."""
    codes = decode(unpack_fp4(q.data.cpu()), "e2m1").double()
    scale = decode(q.scale.cpu().view(torch.uint8), E4M3).double()
    if weight_2d:
        scale = scale.repeat_interleave(16, dim=0)
    return codes * scale.repeat_interleave(16, dim=1) * q.global_scale.double().cpu()


@pytest.mark.parametrize("n,k,weight_2d", [(128, 128, False), (200, 272, False), (256, 384, True), (16, 16, False),
                                           (144, 1040, True)])
def test_decode_emulation_is_exact(n, k, weight_2d):
    q = _nvfp4(n, k, weight_2d, zero_rows=(3, 130) if n > 130 else (3,), zero_cols=range(16, min(k, 32)))
    packed = pack_nvfp4(q.data, q.scale, q.global_scale, weight_2d)
    assert packed.data.shape == (packed.n_tiles * packed.k_chunks * CHUNK_BYTES // 256, 256)
    torch.testing.assert_close(unpack_codes_emulated(packed), _exact_dequant(q, weight_2d), rtol=0, atol=0)


def test_zero_scale_blocks_store_zero_codes():
    """A zero scale with nonzero codes (a checkpoint may have them) still dequantizes to zero."""
    q = _nvfp4(128, 128)
    scale = q.scale.clone()
    scale[5, 2] = 0
    packed = pack_nvfp4(q.data, scale, q.global_scale)
    w = unpack_codes_emulated(packed)
    assert torch.all(w[5, 32:48] == 0)
    assert torch.all(decoded_tile_emulated(packed, 0, 0)[5, 32:48] == 0)


def test_reference_matches_float64_product():
    q = _nvfp4(64, 96)
    packed = pack_nvfp4(q.data, q.scale, q.global_scale)
    x = torch.randn(5, 96)
    bias = torch.randn(64)
    y = weight_only_reference(x, packed, bias)
    expect = (x.double() @ _exact_dequant(q, False).t() + bias.double()).float()
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad,match", [
    (lambda q: dict(weight=q.data.to(torch.int8)), "weight: expected a uint8"),
    (lambda q: dict(weight_scale=q.scale.float()), "weight_scale: expected float8_e4m3fn"),
    (lambda q: dict(weight_scale=q.scale[:, :3]), "weight_scale: expected float8_e4m3fn"),
    (lambda q: dict(weight_scale_2=torch.ones(2)), "weight_scale_2: expected one FP32"),
    (lambda q: dict(weight=q.data[:, :7], weight_scale=q.scale[:, :0]), "not a multiple of 16"),
    (lambda q: dict(weight_scale=torch.full_like(q.scale.view(torch.uint8), 0x7F).view(torch.float8_e4m3fn)),
     "finite and non-negative"),
    (lambda q: dict(weight_scale=(-q.scale.float()).to(torch.float8_e4m3fn)), "finite and non-negative"),
])
def test_pack_rejects_bad_tensors(bad, match):
    q = _nvfp4(32, 64)
    args = dict(weight=q.data, weight_scale=q.scale, weight_scale_2=q.global_scale)
    args.update(bad(q))
    with pytest.raises(ValueError, match=match):
        pack_nvfp4(**args)


def _fp8(n: int, k: int, device="cpu"):
    w = torch.randn(n, k, device=device)
    w[1] = 0
    w[2, :9] = 1e-7  # E4M3 subnormals after scaling
    return quantize(w, get_recipe("fp8_block128x128"))


def _exact_fp8(q) -> torch.Tensor:
    n, k = q.shape
    scale = q.scale.double().cpu().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return q.data.cpu().double() * scale


@pytest.mark.parametrize("n,k", [(64, 128), (200, 272), (256, 1040), (16, 16)])
def test_fp8_decode_emulation_is_exact(n, k):
    q = _fp8(n, k)
    packed = pack_fp8(q.data, q.scale)
    assert packed.data.shape == (packed.n_tiles * packed.k_chunks * 32, 256)
    torch.testing.assert_close(unpack_fp8_emulated(packed), _exact_fp8(q), rtol=0, atol=0)


@gpu
@needs_gpu
def test_pack_fp8_puts_the_scales_on_the_weights_device():
    """A CUDA weight with host scales (e.g. loaded apart): the kernel reads both from the GPU."""
    q = _fp8(200, 272)
    packed = pack_fp8(q.data.cuda(), q.scale.cpu())
    assert packed.data.is_cuda and packed.scale.is_cuda
    x = torch.randn(4, 272, dtype=torch.bfloat16, device="cuda")
    expect = weight_only(x, pack_fp8(q.data.cuda(), q.scale.cuda()), q.to("cuda"), None)
    torch.testing.assert_close(weight_only(x, packed, q.to("cuda"), None), expect, rtol=0, atol=0)


def test_fp8_decode_every_code():
    """Every finite E4M3 code (subnormals and -0 included), ~64 times each over a word's positions."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    weight = codes[torch.randperm(64 * 256, generator=torch.Generator().manual_seed(0)) % codes.numel()]
    weight = weight.view(64, 256).view(torch.float8_e4m3fn)
    packed = pack_fp8(weight, torch.ones(1, 2))
    decoded = unpack_fp8_emulated(packed)
    assert torch.equal(decoded, weight.double())
    assert torch.equal(torch.signbit(decoded), torch.signbit(weight.float()))


@pytest.mark.parametrize("bad,match", [
    (lambda q: dict(weight=q.data.view(torch.uint8)), "weight: expected a float8_e4m3fn"),
    (lambda q: dict(weight=torch.full_like(q.data.view(torch.uint8), 0xFF).view(torch.float8_e4m3fn)),
     "weight: NaN E4M3 codes"),
    (lambda q: dict(scale=q.scale.double()), "scale: expected float32"),
    (lambda q: dict(scale=q.scale[:, :1]), "scale: expected float32"),
])
def test_pack_fp8_rejects_bad_tensors(bad, match):
    q = _fp8(64, 256)
    args = dict(weight=q.data, scale=q.scale)
    args.update(bad(q))
    with pytest.raises(ValueError, match=match):
        pack_fp8(**args)


@pytest.mark.parametrize("bad,match", [
    (lambda p: dict(scale=torch.ones(200, 3)), r"scale: expected a contiguous float32 \(2, 3\)"),  # per row
    (lambda p: dict(scale=p.scale.half()), "scale: expected a contiguous float32"),
    (lambda p: dict(scale=p.scale[:, :1]), r"scale: expected .* \(2, 3\)"),
    (lambda p: dict(scale=torch.ones(3, 2).t()), "scale: expected a contiguous"),
    (lambda p: dict(scale=p.scale.to("meta")), "scale: on meta, but data is on cpu"),
    (lambda p: dict(data=p.data[:-32]), r"data: expected uint8 \(384, 256\)"),
    (lambda p: dict(data=p.data.view(torch.float8_e4m3fn)), "data: expected uint8"),
    (lambda p: dict(n=-1), "n: expected an int"),
])
def test_a_hand_built_packed_fp8_is_checked(bad, match):
    """PackedFP8 built by hand (not pack_fp8): a scale grid of another shape, dtype or layout was
    taken as it was (the emulation sliced a larger grid: a silent wrong product)."""
    q = _fp8(200, 272)
    packed = pack_fp8(q.data, q.scale)
    args = dict(data=packed.data, scale=packed.scale, n=packed.n, k=packed.k)
    args.update(bad(packed))
    with pytest.raises(ValueError, match=match):
        PackedFP8(**args)


# ----------------------------------------------------------------------------- grouped (CPU)
def _experts(e: int, n: int, k: int, device="cpu", zero_expert=None):
    qs = [_nvfp4(n, k, device=device, zero_rows=range(n) if i == zero_expert else ()) for i in range(e)]
    packed = pack_nvfp4_experts(torch.stack([q.data for q in qs]), torch.stack([q.scale for q in qs]),
                                torch.stack([q.global_scale.reshape(()) for q in qs]).float())
    return packed, [_exact_dequant(q, False) for q in qs]


def _group_ends(counts, device="cpu"):
    return torch.tensor(counts, dtype=torch.int32, device=device).cumsum(0).to(torch.int32)


def test_pack_experts_is_each_expert_packed():
    qs = [_nvfp4(200, 272) for _ in range(3)]
    packed = pack_nvfp4_experts(torch.stack([q.data for q in qs]), torch.stack([q.scale for q in qs]),
                                torch.stack([q.global_scale.reshape(()) for q in qs]).float())
    assert packed.experts == 3 and packed.tiles.shape[0] == 3 * packed.n_tiles
    for e, q in enumerate(qs):
        one = pack_nvfp4(q.data, q.scale, q.global_scale)
        assert torch.equal(packed.expert(e).data, one.data)
        assert torch.equal(packed.expert(e).global_scale, one.global_scale)


@pytest.mark.parametrize("bad,match", [
    ({"weight": torch.zeros(2, 64, 32, dtype=torch.uint8)[0]}, "weight: expected a 3-d"),
    ({"weight_scale_2": torch.ones(3)}, "weight_scale_2: expected a 1-d tensor with one entry per expert"),
    ({"weight": torch.zeros(0, 64, 32, dtype=torch.uint8), "weight_scale": torch.zeros(0, 64, 4).to(
        torch.float8_e4m3fn), "weight_scale_2": torch.ones(0)}, "no experts"),
])
def test_pack_experts_rejects_bad_tensors(bad, match):
    args = {"weight": torch.zeros(2, 64, 32, dtype=torch.uint8),
            "weight_scale": torch.zeros(2, 64, 4).to(torch.float8_e4m3fn), "weight_scale_2": torch.ones(2)}
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        pack_nvfp4_experts(**args)


def test_grouped_reference_is_each_experts_product():
    packed, dequant = _experts(4, 72, 160, zero_expert=2)
    counts = [3, 0, 5, 2]
    x = torch.randn(12, 160)  # 10 routed rows, 2 rows past the last group
    y = grouped_weight_only_reference(x, packed, _group_ends(counts))
    start = 0
    for e, c in enumerate(counts):
        expect = (x[start:start + c].double() @ dequant[e].t()).float()
        torch.testing.assert_close(y[start:start + c], expect, rtol=1e-5, atol=1e-5)
        start += c
    assert torch.equal(y[10:], torch.zeros(2, 72))


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_fallback_on_a_cuda_device(monkeypatch):
    """The reference on CUDA operands (what any GPU but Hopper, or x not in bf16, runs): the
    emulated decode mixed a CUDA chunk with its CPU index tensors and raised."""
    from lowprec.gemm.ops import grouped_weight_only

    monkeypatch.setenv("LOWPREC_BACKEND", "reference")
    packed, dequant = _experts(3, 72, 160, device="cuda")
    torch.testing.assert_close(unpack_codes_emulated(packed.expert(1)), dequant[1], rtol=0, atol=0)
    counts = [3, 0, 2]
    x = torch.randn(6, 160, device="cuda")
    y = grouped_weight_only(x, packed, _group_ends(counts, "cuda"))
    start = 0
    for e, c in enumerate(counts):
        expect = (x[start:start + c].double() @ dequant[e].cuda().t()).float()
        torch.testing.assert_close(y[start:start + c], expect, rtol=1e-5, atol=1e-5)
        start += c
    assert torch.equal(y[5:], torch.zeros(1, 72, device="cuda"))


@pytest.mark.parametrize("experts", [1, 3, 8, 64, 256])
def test_grouped_grid_holds_every_nonempty_tile(experts):
    """The grid the launcher sizes from R and E alone has room for the non-empty tiles of any
    split of R rows over the experts (random, one-expert and spread-out splits)."""
    from lowprec.gemm.sm90.weight_only_interface import grouped_tiles

    gen = torch.Generator().manual_seed(experts)
    for rows in (1, 2, 7, 8, 9, 64, 100, 1000, 4096):
        tile_m, z_tiles = grouped_tiles(rows, experts)
        splits = [torch.multinomial(torch.ones(experts), rows, replacement=True, generator=gen).bincount(
            minlength=experts)]
        splits.append(torch.zeros(experts, dtype=torch.long).index_fill_(0, torch.tensor([0]), rows))
        spread = torch.full((experts,), rows // experts)
        spread[: rows % experts] += 1
        splits.append(spread)
        for counts in splits:
            assert int(counts.sum()) == rows
            needed = int(((counts + tile_m - 1) // tile_m).sum())
            assert needed <= z_tiles, (rows, experts, tile_m, needed, z_tiles)


def test_grouped_op_rejects_bad_arguments():
    from lowprec.gemm.ops import grouped_weight_only

    packed, _ = _experts(2, 64, 128)
    with pytest.raises(ValueError, match="group_ends: expected int32"):
        grouped_weight_only(torch.randn(4, 128), packed, torch.tensor([2, 4]))
    with pytest.raises(ValueError, match="x: expected a float tensor"):
        grouped_weight_only(torch.randn(4, 64), packed, _group_ends([2, 2]))
    with pytest.raises(ValueError, match="group_ends: expected non-decreasing"):
        grouped_weight_only(torch.randn(4, 128), packed, _group_ends([3, -1]))
    with pytest.raises(ValueError, match="at most R=4"):
        grouped_weight_only(torch.randn(4, 128), packed, _group_ends([3, 2]))
    with pytest.raises(TypeError, match="packed: expected a PackedNVFP4Experts"):
        grouped_weight_only(torch.randn(4, 128), packed.expert(0), _group_ends([2, 2]))


def test_split_keeps_one_wave():
    """Split-K fills the GPU to about one CTA per SM, but not into a second wave of resident CTAs
    (6144 rows at 64-128 tokens: 96 tiles, one CTA per SM; two splits measured 1.5x slower)."""
    from lowprec.gemm.sm90.weight_only_interface import choose_split

    assert choose_split(96, 32, 132, resident=132) == 1
    assert choose_split(96, 32, 132, resident=264) == 2  # two CTAs per SM: 192 fit at once
    assert choose_split(64, 32, 132, resident=132) == 2
    assert choose_split(48, 32, 132, resident=264) == 4 and choose_split(48, 32, 132, resident=132) == 2
    assert choose_split(448, 32, 132, resident=132) == 1
    assert choose_split(8, 4, 132, resident=264) == 1  # too few chunks to split


def test_grouped_prefill_rule():
    """The per-expert prefill path where each expert has enough rows and work to hide its host time
    (measured: benchmarks/nvfp4_grouped_prefill_crossover.py)."""
    from lowprec.gemm.sm90.weight_only_interface import DEQUANT_MIN_M, grouped_prefill

    assert grouped_prefill(8 * DEQUANT_MIN_M, 8, 28672, 4096)  # E8 gate-up, 1024 rows each
    assert not grouped_prefill(8 * DEQUANT_MIN_M - 1, 8, 28672, 4096)  # fewer rows
    assert grouped_prefill(64 * DEQUANT_MIN_M, 64, 7168, 2048)  # E64 down
    assert not grouped_prefill(128 * 4 * DEQUANT_MIN_M, 128, 2048, 768)  # small experts: host-bound


def test_host_global_scale_is_read_once_per_update():
    """The prefill path's alpha: read to the host once, again only after an in-place update of the
    tensor or of the one it views (a read per call would be a sync per call)."""
    from lowprec.gemm.sm90 import weight_only_interface as wo

    scales = torch.tensor([0.5, 3.0])
    view = scales[1:2]
    assert wo._host_value(view) == 3.0 and wo._host_value(scales[0:1]) == 0.5
    reads = []
    real_float = float
    try:
        wo.float = lambda t: reads.append(1) or real_float(t)  # counts the reads of the module's calls
        assert wo._host_value(scales[1:2]) == 3.0 and not reads, "read again without an update"
        scales.mul_(2)
        assert wo._host_value(view) == 6.0 and wo._host_value(scales[0:1]) == 1.0 and len(reads) == 2
    finally:
        del wo.float


# ----------------------------------------------------------------------------- compile (CI)
def _shipped():
    from lowprec.gemm.sm90.weight_only_interface import SHIPPED

    return SHIPPED


@needs_cutlass
@pytest.mark.parametrize("fmt,tile_m,splits,grouped", _shipped())
def test_compile_sm90(fmt, tile_m, splits, grouped):
    from lowprec.gemm.sm90.weight_only_interface import build_kernel, warp_mma_for
    from lowprec.runtime.compile import local_memory_ops, nvdisasm_path, sass_of

    compiled = build_kernel(fmt, tile_m, splits, grouped=grouped)
    if nvdisasm_path() is None:
        pytest.skip("nvdisasm not found: compiled, SASS not checked")
    sass = sass_of(compiled)
    if warp_mma_for(fmt, tile_m):  # one chunk per loop trip: 4 k-steps of mma.sync, x by ldmatrix
        assert sass.count("HMMA.16816.F32.BF16") >= 4 and "HGMMA" not in sass, "expected bf16 mma.sync"
        assert sass.count("LDSM.16.M88") >= 4, "expected ldmatrix loads of the x fragments"
        assert sass.count("HMUL2.BF16") >= 16, "expected one bf16x2 scale multiply per A register"
        assert "LDS.128" in sass, "expected 16-byte shared loads of the codes"
    else:
        assert sass.count("HGMMA.64x") >= 4 and "F32.BF16" in sass, "expected bf16 wgmma with A from registers"
        assert sass.count("HMUL2.BF16") >= 32, "expected one bf16x2 scale multiply per A register"
        assert sass.count("LDS.128") >= 3, "expected 16-byte shared loads of the codes and scales"
    assert "ACQBULK" in sass, "no griddepcontrol.wait: programmatic dependent launch is unsafe"
    if grouped:  # each warp finds its CTA's expert tile: a warp scan and a ballot
        assert sass.count("SHFL.UP") >= 5 and "VOTE" in sass, "expected the warp scan over the experts' tiles"
    if splits > 1:
        assert "UCGABAR_ARV" in sass and "UCGABAR_WAIT" in sass, "no cluster barrier before the split-K reduction"
    assert local_memory_ops(sass) == 0


@needs_cutlass
def test_compile_dequant_sm90():
    from lowprec.gemm.sm90.weight_only_interface import build_dequant_kernel
    from lowprec.runtime.compile import local_memory_ops, nvdisasm_path, sass_of

    compiled = build_dequant_kernel()
    if nvdisasm_path() is None:
        pytest.skip("nvdisasm not found: compiled, SASS not checked")
    sass = sass_of(compiled)
    assert sass.count("LDG.E.128") >= 2, "expected 16-byte loads of the code records"
    assert sass.count("HMUL2.BF16") >= 32, "expected one bf16x2 scale multiply per output word"
    assert sass.count("STS") >= 32 and sass.count("STG.E.128") >= 8, "expected row segments through shared memory"
    assert local_memory_ops(sass) == 0


# ----------------------------------------------------------------------------- GPU
def _gpu_case(m, n, k, weight_2d=False, with_bias=False, zero_rows=()):
    q = _nvfp4(n, k, weight_2d, device="cuda", zero_rows=zero_rows)
    packed = pack_nvfp4(q.data, q.scale, q.global_scale, weight_2d)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if with_bias else None
    return x, packed, bias, q


@gpu
@needs_gpu
@pytest.mark.parametrize("m,n,k,weight_2d,with_bias", [
    (1, 4096, 4096, False, False), (4, 6144, 4096, False, True), (16, 4096, 14336, False, False),
    (1, 200, 272, False, True), (3, 1024, 1040, True, False), (33, 384, 512, False, True),
    (64, 512, 2048, True, True), (128, 256, 1024, False, False), (200, 640, 768, False, True),
    (300, 128, 256, False, False), (8, 28672, 512, False, False), (1, 26000, 1040, False, True),
    (12, 1008, 1040, True, True), (24, 1000, 1040, False, True),
])
def test_kernel_matches_reference(m, n, k, weight_2d, with_bias):
    from lowprec.gemm.sm90.weight_only_interface import weight_only_nvfp4

    x, packed, bias, q = _gpu_case(m, n, k, weight_2d, with_bias, zero_rows=(1,))
    y = weight_only_nvfp4(x, packed, bias)
    expect = x.double() @ _exact_dequant(q, weight_2d).cuda().t()
    if bias is not None:
        expect = expect + bias.double()
    # FP32 accumulation of exact bf16 products, then one bf16 rounding (<= 2^-8 relative)
    err = (y.double() - expect).abs()
    bound = 2.0 ** -8 * expect.abs() + 1e-4 * expect.abs().max()
    assert torch.all(err <= bound), ((err - bound).max().item(), expect.abs().max().item())
    rel = err.norm() / expect.norm()
    assert rel < 3e-3, rel.item()
    assert torch.equal(weight_only_nvfp4(x, packed, bias), y), "not deterministic"


@gpu
@needs_gpu
@pytest.mark.parametrize("n,k,weight_2d", [(4096, 4096, False), (200, 272, False), (1040, 1040, True)])
def test_dequant_kernel_is_exact(n, k, weight_2d):
    """The prefill path's bf16 weight: code * scale * 2^-DECODE_EXP, every bit (tails in N and K)."""
    from lowprec.gemm.sm90.weight_only_interface import compile_dequant_kernel
    from lowprec.gemm.weight_only import DECODE_EXP

    q = _nvfp4(n, k, weight_2d, device="cuda", zero_rows=(1,))
    packed = pack_nvfp4(q.data, q.scale, q.global_scale, weight_2d)
    w = torch.full((n, k), float("nan"), device="cuda", dtype=torch.bfloat16)
    compile_dequant_kernel()(packed.data.view(torch.int32).view(-1), w.view(torch.int32), 0, packed.k_chunks)
    expect = _exact_dequant(q, weight_2d) / q.global_scale.double().cpu() * 2.0 ** -DECODE_EXP
    assert torch.equal(expect.to(torch.bfloat16).double(), expect), "the expected weight is not exact in bf16"
    assert torch.equal(w.cpu().double(), expect)


@gpu
@needs_gpu
@pytest.mark.parametrize("m,n,k,weight_2d,with_bias,slice_rows", [
    (1024, 4096, 4096, False, False, None), (1100, 1008, 1040, True, True, None),
    (1024, 1000, 272, False, True, 128),  # the weight decoded in row slices of 128: 8 GEMMs
])
def test_prefill_path_matches_reference(monkeypatch, m, n, k, weight_2d, with_bias, slice_rows):
    from lowprec.gemm.sm90 import weight_only_interface as wo

    if slice_rows is not None:
        monkeypatch.setattr(wo, "_DEQUANT_SLICE_BYTES", 2 * k * slice_rows)
    taken = []
    dequant_matmul = wo._dequant_matmul
    monkeypatch.setattr(wo, "_dequant_matmul", lambda *a: taken.append(1) or dequant_matmul(*a))
    assert m >= wo.DEQUANT_MIN_M
    x, packed, bias, q = _gpu_case(m, n, k, weight_2d, with_bias, zero_rows=(1,))
    y = wo.weight_only_nvfp4(x, packed, bias)
    assert taken, "the prefill path was not taken"
    expect = x.double() @ _exact_dequant(q, weight_2d).cuda().t()
    if bias is not None:
        expect = expect + bias.double()
    err = (y.double() - expect).abs()
    assert torch.all(err <= 2.0 ** -8 * expect.abs() + 1e-4 * expect.abs().max()), err.max().item()


@gpu
@needs_gpu
def test_prefill_path_follows_in_place_updates_and_captures_on_the_kernel():
    """An in-place update of the global scale shows in the next call; inside a CUDA-graph capture
    (no host read allowed) the weight-only kernel runs instead."""
    from lowprec.gemm.sm90 import weight_only_interface as wo

    m = wo.DEQUANT_MIN_M
    x, packed, bias, _ = _gpu_case(m, 512, 1024, with_bias=False)
    before = wo.weight_only_nvfp4(x, packed)
    packed.global_scale.mul_(2)
    assert torch.equal(wo.weight_only_nvfp4(x, packed), 2 * before)
    kernel = wo._launch("nvfp4", x, packed, packed.global_scale.view(1, 1), None)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        wo.weight_only_nvfp4(x, packed)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            y = wo.weight_only_nvfp4(x, packed)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, kernel)


@gpu
@needs_gpu
def test_kernel_cuda_graph_replay_equals_eager():
    from lowprec.gemm.sm90.weight_only_interface import weight_only_nvfp4

    x, packed, bias, _ = _gpu_case(4, 4096, 4096, with_bias=True)
    eager = weight_only_nvfp4(x, packed, bias)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        weight_only_nvfp4(x, packed, bias)  # scratch buffers of this stream exist before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            y = weight_only_nvfp4(x, packed, bias)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, eager)


@gpu
@needs_gpu
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("m", [3, 40])
def test_kernel_every_split(monkeypatch, splits, m):
    """Each split-K cluster size, on tails in N, K (chunks not divisible by the splits) and M."""
    from lowprec.gemm.sm90 import weight_only_interface as wo

    monkeypatch.setattr(wo, "choose_split", lambda *args: splits)
    x, packed, bias, q = _gpu_case(m, 200, 1296, with_bias=True)
    y = wo.weight_only_nvfp4(x, packed, bias)
    expect = x.double() @ _exact_dequant(q, False).cuda().t() + bias.double()
    err = (y.double() - expect).abs()
    assert torch.all(err <= 2.0 ** -8 * expect.abs() + 1e-4 * expect.abs().max()), err.max().item()


@gpu
@needs_gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (5, 200, 272), (16, 1536, 4096), (33, 384, 1040), (64, 640, 2048),
                                   (8, 4096, 14336), (1, 28000, 512), (1, 28000, 1024),
                                   (16, 26000, 1040), (27, 1000, 1040)])
def test_fp8_kernel_matches_reference(m, n, k):
    from lowprec.gemm.sm90.weight_only_interface import weight_only_fp8

    q = _fp8(n, k, device="cuda")
    packed = pack_fp8(q.data, q.scale)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = weight_only_fp8(x, packed, bias)
    expect = x.double() @ _exact_fp8(q).cuda().t() + bias.double()
    err = (y.double() - expect).abs()
    assert torch.all(err <= 2.0 ** -8 * expect.abs() + 1e-4 * expect.abs().max()), err.max().item()
    assert torch.equal(weight_only_fp8(x, packed, bias), y), "not deterministic"


@gpu
@needs_gpu
@pytest.mark.parametrize("splits", SPLITS)
def test_fp8_kernel_every_split(monkeypatch, splits):
    from lowprec.gemm.sm90 import weight_only_interface as wo

    monkeypatch.setattr(wo, "choose_split", lambda *args: splits)
    q = _fp8(200, 1296, device="cuda")
    packed = pack_fp8(q.data, q.scale)
    x = torch.randn(7, 1296, device="cuda", dtype=torch.bfloat16)
    y = wo.weight_only_fp8(x, packed)
    expect = x.double() @ _exact_fp8(q).cuda().t()
    err = (y.double() - expect).abs()
    assert torch.all(err <= 2.0 ** -8 * expect.abs() + 1e-4 * expect.abs().max()), err.max().item()


@pytest.mark.parametrize("layer_kind", ["nvfp4", "fp8"])
def test_layer_traces_the_weight_only_op_fullgraph(layer_kind):
    """torch.compile (fullgraph) traces lowprec::weight_only (here its CPU fallback, which rebuilds
    the weight from the packed form: the product eager computes); opcheck of the op passes."""
    from lowprec.gemm.ops import weight_only_op
    from lowprec.nn import FP8InferenceLinear, NVFP4InferenceLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 64, dtype=torch.bfloat16)
    layer = (NVFP4InferenceLinear if layer_kind == "nvfp4" else FP8InferenceLinear).from_linear(linear)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = layer(x)
        if layer_kind == "fp8":  # its packed copy comes with the first eager call on a GPU
            layer._packed = ((), pack_fp8(layer.weight, layer.weight_scale))
        packed = layer.packed_weight()
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(compiled, eager)
    scale = packed.global_scale if layer_kind == "nvfp4" else packed.scale
    torch.library.opcheck(weight_only_op, (x, packed.data, scale, layer_kind, packed.n, packed.k,
                                           layer.bias.to(torch.bfloat16)),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_unpack_is_the_inverse_of_pack():
    from lowprec.gemm.weight_only import unpack_fp8, unpack_nvfp4

    for weight_2d in (False, True):
        q = _nvfp4(144, 1040, weight_2d)
        w, s = unpack_nvfp4(pack_nvfp4(q.data, q.scale, q.global_scale, weight_2d), weight_2d)
        assert torch.equal(w, q.data) and torch.equal(s.view(torch.uint8), q.scale.view(torch.uint8))
    q = _fp8(200, 272)
    assert torch.equal(unpack_fp8(pack_fp8(q.data, q.scale)).view(torch.uint8), q.data.view(torch.uint8))


@gpu
@needs_gpu
@pytest.mark.parametrize("layer_kind,m", [("nvfp4", 4), ("fp8", 4), ("nvfp4", 1024)])
def test_layer_compiled_equals_eager_with_the_kernel(layer_kind, m):
    """After an eager call made the packed copy, torch.compile (inductor, fullgraph) runs the same
    kernel through lowprec::weight_only (NVFP4 at 1024 rows: the prefill path): the same bits."""
    from lowprec.nn import FP8InferenceLinear, NVFP4InferenceLinear

    linear = torch.nn.Linear(1024, 512, device="cuda", dtype=torch.bfloat16)
    layer = (NVFP4InferenceLinear if layer_kind == "nvfp4" else FP8InferenceLinear).from_linear(linear)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True)(x)
    assert torch.equal(compiled, eager)


def _grouped_gpu_case(counts, n, k, extra_rows=0, zero_expert=None):
    packed, dequant = _experts(len(counts), n, k, device="cuda", zero_expert=zero_expert)
    x = torch.randn(sum(counts) + extra_rows, k, device="cuda", dtype=torch.bfloat16)
    return x, packed, dequant, _group_ends(counts, "cuda")


def _check_grouped(y, x, dequant, counts):
    start = 0
    for e, c in enumerate(counts):
        if c:
            expect = x[start:start + c].double() @ dequant[e].cuda().t()
            err = (y[start:start + c].double() - expect).abs()
            bound = 2.0 ** -8 * expect.abs() + 1e-4 * expect.abs().max()
            assert torch.all(err <= bound), (e, (err - bound).max().item())
        start += c
    assert torch.all(y[start:] == 0), "rows after the last group must be zero"


@gpu
@needs_gpu
@pytest.mark.parametrize("counts,n,k,extra", [
    ([1, 0, 0, 1, 0, 1, 1, 0], 3072, 4096, 0),  # decode: a token's top-4 over 8 experts
    ([0, 2, 0, 0, 5, 1, 0, 0, 0, 0, 0, 3], 200, 272, 3),  # tails in N and K, rows after the last group
    ([40, 0, 7, 130], 512, 1024, 0),  # several token tiles in one expert
    ([0, 0, 0], 128, 256, 4),  # no routed rows at all
    ([17] * 64, 256, 512, 0),  # many experts, a full warp scan
    ([12, 0, 16, 9, 14], 384, 1040, 2),  # 16-token tiles (mma.sync, two n8 blocks)
])
def test_grouped_kernel_matches_reference(counts, n, k, extra):
    from lowprec.gemm.sm90.weight_only_interface import grouped_weight_only_nvfp4

    x, packed, dequant, ends = _grouped_gpu_case(counts, n, k, extra, zero_expert=1)
    y = grouped_weight_only_nvfp4(x, packed, ends)
    _check_grouped(y, x, dequant, counts)
    assert torch.equal(grouped_weight_only_nvfp4(x, packed, ends), y), "not deterministic"


@gpu
@needs_gpu
@pytest.mark.parametrize("counts,n,k,extra,min_m", [
    ([1100, 0, 2100], 4096, 4096, 3, None),  # the shipped thresholds: both busy experts decoded
    ([40, 0, 7, 130, 33], 200, 272, 5, 16),  # experts under the threshold on the kernel, tails
    ([0, 64, 0], 384, 1040, 0, 16),  # one expert holds every row
])
def test_grouped_prefill_path_matches_reference(monkeypatch, counts, n, k, extra, min_m):
    from lowprec.gemm.sm90 import weight_only_interface as wo

    if min_m is not None:
        monkeypatch.setattr(wo, "DEQUANT_MIN_M", min_m)
        monkeypatch.setattr(wo, "GROUPED_DEQUANT_MIN_WORK", 0)
    taken = []
    per_expert = wo._grouped_per_expert
    monkeypatch.setattr(wo, "_grouped_per_expert", lambda *a: taken.append(1) or per_expert(*a))
    x, packed, dequant, ends = _grouped_gpu_case(counts, n, k, extra, zero_expert=1)
    assert x.shape[0] >= wo.DEQUANT_MIN_M * len(counts)
    y = wo.grouped_weight_only_nvfp4(x, packed, ends)
    assert taken, "the prefill path was not taken"
    _check_grouped(y, x, dequant, counts)
    assert torch.equal(wo.grouped_weight_only_nvfp4(x, packed, ends), y), "not deterministic"


@gpu
@needs_gpu
@pytest.mark.parametrize("splits", SPLITS)
def test_grouped_kernel_every_split(monkeypatch, splits):
    from lowprec.gemm.sm90 import weight_only_interface as wo

    monkeypatch.setattr(wo, "choose_split", lambda *args: splits)
    counts = [3, 0, 9, 1]
    x, packed, dequant, ends = _grouped_gpu_case(counts, 200, 1296, 2)
    _check_grouped(wo.grouped_weight_only_nvfp4(x, packed, ends), x, dequant, counts)


@gpu
@needs_gpu
@pytest.mark.parametrize("min_m", [None, 1])
def test_grouped_kernel_cuda_graph_follows_the_group_ends(monkeypatch, min_m):
    """Captured once, the launch reads the group ends at run time: a new routing in the same
    buffer gives that routing's result. At prefill sizes too (``min_m``: the threshold lowered):
    a capture cannot read the row ranges to the host, so it keeps the grouped kernel."""
    from lowprec.gemm.sm90 import weight_only_interface as wo
    from lowprec.gemm.sm90.weight_only_interface import grouped_weight_only_nvfp4

    x, packed, dequant, ends = _grouped_gpu_case([2, 0, 3, 3], 256, 512)
    grouped_weight_only_nvfp4(x, packed, ends)  # scratch buffers exist before capture
    if min_m is not None:
        monkeypatch.setattr(wo, "DEQUANT_MIN_M", min_m)
        monkeypatch.setattr(wo, "GROUPED_DEQUANT_MIN_WORK", 0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = grouped_weight_only_nvfp4(x, packed, ends)
    for counts in ([2, 0, 3, 3], [0, 8, 0, 0], [1, 1, 1, 5]):
        ends.copy_(_group_ends(counts, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        _check_grouped(y, x, dequant, counts)


def test_grouped_kernel_takes_only_int32_group_ends_of_e_entries():
    from lowprec.gemm.sm90.config import grouped_weight_only_unsupported

    packed, _ = _experts(3, 64, 128)
    x = torch.randn(5, 128).to(torch.bfloat16)
    assert grouped_weight_only_unsupported(x, packed, _group_ends([2, 2, 1])) is None
    assert "group_ends" in grouped_weight_only_unsupported(x, packed, _group_ends([2, 2, 1, 0]))
    assert "group_ends" in grouped_weight_only_unsupported(x, packed, _group_ends([2, 2, 1]).long())


@pytest.mark.parametrize("n, k, weight_2d", [(0, 32, False), (0, 32, True), (32, 0, False), (0, 0, False)])
def test_pack_nvfp4_takes_an_empty_weight(n, k, weight_2d):
    """As pack_fp8 does: an empty weight packs, unpacks and multiplies (zeros / an empty result)."""
    from lowprec.gemm.ops import grouped_weight_only
    from lowprec.gemm.weight_only import unpack_nvfp4

    weight = torch.zeros(n, k // 2, dtype=torch.uint8)
    scale = torch.ones(n // 16 if weight_2d else n, k // 16).to(torch.float8_e4m3fn)
    packed = pack_nvfp4(weight, scale, torch.tensor(0.5), weight_2d)
    w, s = unpack_nvfp4(packed, weight_2d)
    assert w.shape == weight.shape and s.shape == scale.shape
    assert unpack_codes_emulated(packed).shape == (n, k)
    x = torch.randn(3, k, dtype=torch.bfloat16)
    y = weight_only_reference(x, packed)
    assert y.shape == (3, n) and (y == 0).all()
    experts = pack_nvfp4_experts(weight[None].expand(2, -1, -1), scale[None].expand(2, -1, -1),
                                 torch.ones(2), weight_2d)
    out = grouped_weight_only(x, experts, torch.tensor([1, 3], dtype=torch.int32))
    assert out.shape == (3, n) and (out == 0).all()


@gpu
@needs_gpu
def test_pack_nvfp4_puts_a_host_global_scale_with_the_weight():
    """A ModelOpt ``weight_scale_2`` left on the host (a 0-d checkpoint tensor) next to CUDA codes:
    the packed global scale goes to the weight's device, and the kernel takes it."""
    from lowprec.gemm.sm90.weight_only_interface import weight_only_nvfp4

    q = quantize(torch.randn(256, 512, device="cuda"), "nvfp4")
    packed = pack_nvfp4(q.data, q.scale, q.global_scale.cpu())
    assert packed.global_scale.device == q.data.device
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    on_device = pack_nvfp4(q.data, q.scale, q.global_scale)
    assert torch.equal(weight_only_nvfp4(x, packed, None), weight_only_nvfp4(x, on_device, None))


def test_constraint_refuses_k_not_a_multiple_of_8():
    """The kernels are compiled for x's K in multiples of 8: an FP8 weight of K = 12 with x a view
    of 16-wide rows (row stride 16, so the stride and alignment checks pass) takes the reference."""
    from lowprec.gemm.sm90.config import weight_only_unsupported

    q = quantize(torch.randn(64, 12), "fp8_block128x128")
    packed = pack_fp8(q.data, q.scale)
    x = torch.randn(4, 16, dtype=torch.bfloat16)[:, :12]
    assert "multiples of 8" in weight_only_unsupported(x, packed, None)
    q = quantize(torch.randn(64, 16), "fp8_block128x128")
    assert weight_only_unsupported(torch.randn(4, 16, dtype=torch.bfloat16), pack_fp8(q.data, q.scale), None) is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -2.0])
def test_invalid_global_scale_is_refused(bad):
    """As the block scales: a global scale that is not finite and non-negative is an error."""
    sd = NVFP4InferenceLinear.from_linear(torch.nn.Linear(64, 32)).state_dict()
    with pytest.raises(ValueError, match="weight_scale_2"):
        pack_nvfp4(sd["weight"], sd["weight_scale"], torch.tensor(bad))
    layer = NVFP4InferenceLinear(64, 32)
    with pytest.raises(ValueError, match="weight_scale_2"):
        layer.set_weight(sd["weight"], sd["weight_scale"], torch.tensor([bad]))
    sd["weight_scale_2"] = torch.tensor(bad)
    with pytest.raises(RuntimeError, match="weight_scale_2"):
        layer.load_state_dict(sd)


def test_valid_global_scales_still_load():
    sd = NVFP4InferenceLinear.from_linear(torch.nn.Linear(64, 32)).state_dict()
    for good in (0.0, 1e-30, 3.5):
        sd["weight_scale_2"] = torch.tensor(good)
        NVFP4InferenceLinear(64, 32).load_state_dict(sd)
