"""Hopper FP8 quantize kernels: compile for sm_90a on any machine; bit-identical to the reference on the GPU."""

import re

import pytest
import torch

import lowprec
from lowprec.quant import quantize_dual, quantize_with_transpose
from lowprec.quant.sm90.config import quantize_unsupported, transpose_unsupported
from lowprec.quant.sm90.interface import KERNELS, build_kernel
from lowprec.recipes import get_recipe
from lowprec.runtime import cubin_arch, local_memory_ops, sass_of

_SWIGLU = ("swiglu_dual", "swiglu_dgate_dual", "swiglu_dup_dual")  # bf16 / fp16 inputs only


@pytest.mark.parametrize("kind, dtype", [(k, d) for k in KERNELS for d in (torch.bfloat16, torch.float16, torch.float32)
                                         if not (k in _SWIGLU and d == torch.float32)])
def test_kernel_compiles_for_sm90a_with_wide_accesses_and_no_spills(kind, dtype):
    sass = sass_of(build_kernel(kind, dtype))
    assert cubin_arch(sass) == "sm_90a"
    assert local_memory_ops(sass) == 0
    # 16-byte loads (bf16/fp16: 8 elements; fp32: two per 8); the streaming kernels copy them
    # global -> shared asynchronously (cp.async: LDGSTS)
    streaming = kind in ("1x128", "dual", "rowwise_staged", *_SWIGLU)
    wide_load = r"LDGSTS\.E\.\w*\.?128" if streaming else r"LDG\.E\.128"
    assert re.search(wide_load, sass)
    assert "F2FP" in sass  # packed cvt to e4m3
    assert "ACQBULK" in sass  # griddepcontrol.wait: safe under programmatic dependent launch


@pytest.mark.parametrize("t_rows", [16, 128])
@pytest.mark.parametrize("kind, dtype", [("dual", torch.bfloat16), ("dual", torch.float32),
                                         ("swiglu_dual", torch.bfloat16)])
def test_block_transpose_variants_compile_without_spills(kind, dtype, t_rows):
    """The dual kernels with the transposed half in 16x128 or 128x128 blocks (``fp8_block_wgrad16``,
    ``fp8_block_wgrad2d``): one scale per 16 columns or per tile, and no local memory; the 128x128
    one needs fewer shuffles than the per-column variant (16x128: two more per block maximum)."""
    sass = sass_of(build_kernel(kind, dtype, t_rows=t_rows))
    assert cubin_arch(sass) == "sm_90a" and local_memory_ops(sass) == 0
    if t_rows == 128:
        assert sass.count("SHFL") < sass_of(build_kernel(kind, dtype)).count("SHFL")
    with pytest.raises(ValueError, match="t_rows"):
        build_kernel("swiglu_dup_dual", torch.bfloat16, t_rows=t_rows)
    with pytest.raises(ValueError, match="t_rows"):
        build_kernel(kind, dtype, t_rows=32)


def _poison_allocator():
    """Leave NaN bytes in the caching allocator so an unwritten output element cannot pass."""
    torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0x7F)


def _same(qa, qb):
    assert qa.shape == qb.shape
    assert torch.equal(qa.data.view(torch.uint8), qb.data.view(torch.uint8))
    assert torch.equal(qa.scale, qb.scale)


def _data(rows, cols, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, cols, device="cuda", generator=g)
    x = x * torch.exp(torch.randn(rows, 1, device="cuda", generator=g))
    x[0, : min(cols, 5)] *= 100  # outliers
    if rows > 2:
        x[2] = 0  # all-zero blocks
    return x.to(dtype)


def _kernel_and_reference(quantize, x, monkeypatch):
    """(kernel result, reference result) of ``quantize(x)``; the kernel's outputs land on poisoned memory."""
    monkeypatch.setenv("LOWPREC_BACKEND", "reference")
    ref = quantize(x)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    _poison_allocator()
    return quantize(x), ref


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 128), (7, 4096), (300, 1040), (1000, 7168), (4096, 16), (4100, 7168)])
def test_1x128_matches_reference(shape, dtype, monkeypatch):
    x = _data(*shape, dtype, seed=sum(shape))
    out, ref = _kernel_and_reference(lambda t: lowprec.quantize(t, "fp8_block1x128"), x, monkeypatch)
    _same(out, ref)
    assert out.scale.stride(0) == 1  # MN-major for the GEMM


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 16), (7, 4096), (300, 1040), (64, 20000), (5, 4112), (33, 14336),
                                   (3, 40000)])
def test_rowwise_matches_reference(shape, dtype, monkeypatch):
    x = _data(*shape, dtype, seed=sum(shape) + 3)
    _same(*_kernel_and_reference(lambda t: lowprec.quantize(t, "fp8_rowwise"), x, monkeypatch))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["swiglu", "swiglu_dgate", "swiglu_dup"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 128), (300, 1040), (2000, 7168), (1000, 272)])
def test_swiglu_dual_matches_reference(kind, shape, dtype, monkeypatch):
    """The dense SwiGLU MLP's fused kernels against torch's FP32 values then both quantizations
    (each input a column slice of a wider buffer, as GEMM outputs may be): the kernels' sigmoid is
    a few ulp off (MUFU ex2 / rcp), so a code may move one E4M3 step where a value sits on a
    rounding boundary, and a scale by an ulp where the block's maximum does."""
    from lowprec.quant.ops import SWIGLU_KINDS, swiglu_dual_codes

    n = SWIGLU_KINDS[kind]
    wide = _data(shape[0], shape[1] * n, dtype, seed=sum(shape) + n) * 4
    inputs = tuple(wide[:, i * shape[1]:(i + 1) * shape[1]] for i in range(n))
    monkeypatch.setenv("LOWPREC_BACKEND", "reference")
    ref = swiglu_dual_codes(kind, inputs)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    _poison_allocator()
    got = swiglu_dual_codes(kind, inputs)
    _near(got, ref)


def _near(got, ref):
    """The SwiGLU kernels' codes within one E4M3 step of the reference's, scales within an ulp."""
    for codes, ref_codes, scales, ref_scales in ((got[0], ref[0], got[1], ref[1]), (got[2], ref[2], got[3], ref[3])):
        assert scales.shape == ref_scales.shape
        torch.testing.assert_close(scales, ref_scales, rtol=1e-5, atol=0)
        step = (codes.view(torch.int8).int() - ref_codes.view(torch.int8).int()).abs()
        assert step.max() <= 1 and (step > 0).float().mean() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("t_rows", [16, 128])
@pytest.mark.parametrize("shape", [(1, 128), (300, 1040), (2000, 7168), (1000, 272), (100, 48)])
def test_swiglu_dual_with_block_transpose_matches_reference(shape, t_rows, monkeypatch):
    from lowprec.quant.ops import swiglu_dual_codes

    wide = _data(shape[0], shape[1] * 2, torch.bfloat16, seed=sum(shape) + 7) * 4
    inputs = (wide[:, :shape[1]], wide[:, shape[1]:])
    monkeypatch.setenv("LOWPREC_BACKEND", "reference")
    ref = swiglu_dual_codes("swiglu", inputs, t_rows=t_rows)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    _poison_allocator()
    got = swiglu_dual_codes("swiglu", inputs, t_rows=t_rows)
    assert got[3].shape == (-(-shape[1] // t_rows), -(-shape[0] // 128))
    _near(got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(4096, 7168), (2112, 7168), (130, 272), (16, 16)])
def test_128x128_matches_reference(shape, dtype, monkeypatch):
    x = _data(*shape, dtype, seed=sum(shape) + 1)
    _same(*_kernel_and_reference(lambda t: lowprec.quantize(t, "fp8_block128x128"), x, monkeypatch))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 128), (300, 1040), (4096, 4096), (1000, 272), (2000, 7168)])
def test_dual_matches_reference(shape, dtype, monkeypatch):
    x = _data(*shape, dtype, seed=sum(shape) + 2)
    (rows, cols), (ref_rows, ref_cols) = _kernel_and_reference(quantize_dual, x, monkeypatch)
    _same(rows, ref_rows)
    _same(cols, ref_cols)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_t", ["fp8_block16x128", "fp8_block128x128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 128), (300, 1040), (4096, 4096), (1000, 272), (2000, 7168), (100, 48)])
def test_dual_with_block_transpose_matches_reference(shape, dtype, recipe_t, monkeypatch):
    x = _data(*shape, dtype, seed=sum(shape) + 5)
    (rows, cols), (ref_rows, ref_cols) = _kernel_and_reference(
        lambda t: quantize_dual(t, "fp8_block1x128", recipe_t), x, monkeypatch)
    assert cols.recipe.name == recipe_t
    _same(rows, ref_rows)
    _same(cols, ref_cols)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(4096, 7168), (2112, 7168), (144, 272), (16, 16), (8, 256, 4096), (3, 128, 272),
                                   (2, 3, 384, 1040)])
def test_128x128_with_transpose_matches_reference(shape, dtype, monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(sum(shape) + 3)
    x = torch.randn(shape, device="cuda", generator=g) * torch.exp(torch.randn(*shape[:-1], 1, device="cuda",
                                                                               generator=g))
    x = x.to(dtype)
    (q, qt), (ref_q, ref_qt) = _kernel_and_reference(quantize_with_transpose, x, monkeypatch)
    _same(q, ref_q)
    _same(qt, ref_qt)
    monkeypatch.setenv("LOWPREC_BACKEND", "reference")  # and the transpose is quantize(xᵀ) itself
    _same(qt, lowprec.quantize(x.transpose(-1, -2).contiguous(), "fp8_block128x128"))


@pytest.mark.gpu
def test_128x128_with_transpose_rows_not_multiple_of_16_take_the_reference(monkeypatch):
    x = _data(130, 272, torch.bfloat16, seed=5)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    with pytest.raises(RuntimeError, match="multiple of 16"):
        quantize_with_transpose(x)
    monkeypatch.setenv("LOWPREC_BACKEND", "auto")
    q, qt = quantize_with_transpose(x)
    monkeypatch.setenv("LOWPREC_BACKEND", "reference")
    _same(qt, lowprec.quantize(x.t().contiguous(), "fp8_block128x128"))


@pytest.mark.gpu
def test_kernel_is_deterministic_and_leaves_input_alone(monkeypatch):
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    x = _data(512, 2048, torch.bfloat16, seed=9)
    before = x.clone()
    a, b = lowprec.quantize(x, "fp8_block1x128"), lowprec.quantize(x, "fp8_block1x128")
    _same(a, b)
    assert torch.equal(x, before)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8, 256, 4096), (3, 128, 272), (2, 3, 384, 1040), (0, 128, 256)])
def test_128x128_batch_of_experts_matches_reference(shape, monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    x = torch.randn(shape, device="cuda", generator=g) * torch.exp(torch.randn(*shape[:-1], 1, device="cuda",
                                                                               generator=g))
    x = x.to(torch.bfloat16)
    _same(*_kernel_and_reference(lambda t: lowprec.quantize(t, "fp8_block128x128"), x, monkeypatch))


@pytest.mark.gpu
def test_128x128_batch_with_partial_row_blocks_takes_the_reference(monkeypatch):
    x = _data(4 * 130, 256, torch.bfloat16, seed=4).view(4, 130, 256)  # a 128-row block would span two experts
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    with pytest.raises(RuntimeError, match="multiple of 128"):
        lowprec.quantize(x, "fp8_block128x128")
    monkeypatch.setenv("LOWPREC_BACKEND", "auto")
    out = lowprec.quantize(x, "fp8_block128x128")
    monkeypatch.setenv("LOWPREC_BACKEND", "reference")
    _same(out, lowprec.quantize(x, "fp8_block128x128"))


def test_grids_past_65535_column_blocks_are_refused():
    """The 128x128 kernels' grid is (row blocks, ceil(cols / 128)), the gathering kernel's (token
    blocks, ceil(C / 128)): gridDim.y is at most 65535."""
    from lowprec.quant.sm90 import config

    def meta(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")

    r = lowprec.get_recipe("fp8_block128x128")
    assert config.quantize_unsupported(meta(16, 65535 * 128 + 16), r) is not None
    assert config.transpose_unsupported(meta(16, 65535 * 128 + 16), r) is not None
    assert config.quantize_unsupported(meta(16, 65535 * 128), r) is None
    r, sources = lowprec.get_recipe("fp8_block1x128"), torch.zeros(128, dtype=torch.int32)
    assert config.gathered_unsupported(meta(64, 65535 * 128 + 16), r, sources) is not None
    assert config.gathered_unsupported(meta(64, 65535 * 128), r, sources) is None


def test_batch_of_one_matrix_is_one_matrix():
    r = get_recipe("fp8_block128x128")
    w = torch.randn(48, 256, dtype=torch.bfloat16)  # out_features 48: a multiple of 16, not of 128
    assert transpose_unsupported(w, r) is None  # eager path (2-D): accepted
    # what lowprec.quant.ops.quantize_128x128_t_fp8 passes the registry: x.view(-1, n, K)
    assert transpose_unsupported(w.view(1, 48, 256), r) is None
    assert quantize_unsupported(w.view(1, 48, 256), r) is None


def test_real_batches_still_need_whole_blocks():
    r = get_recipe("fp8_block128x128")
    w = torch.randn(2, 48, 256, dtype=torch.bfloat16)
    assert transpose_unsupported(w, r) is not None
    assert quantize_unsupported(w, r) is not None


@pytest.mark.gpu
def test_one_matrix_as_a_batch_of_one_takes_the_transposing_kernel(monkeypatch):
    """[1, n, K] with n not a multiple of 128 (what the traced op passes for a 2-D weight): the
    kernel's bits of the 2-D call."""
    import lowprec

    w = torch.randn(48, 256, device="cuda").to(torch.bfloat16)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")  # the kernel or raise
    q3, t3 = lowprec.quant.quantize_with_transpose(w.view(1, 48, 256))
    q2, t2 = lowprec.quant.quantize_with_transpose(w)
    for x, y in ((q3, q2), (t3, t2)):
        assert torch.equal(x.data.view(torch.uint8).flatten(), y.data.view(torch.uint8).flatten())
        assert torch.equal(x.scale.flatten(), y.scale.flatten())
