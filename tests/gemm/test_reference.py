import pytest
import torch

import lowprec
from lowprec.gemm.weight_only import pack_nvfp4, weight_only_reference
from lowprec.recipes import RECIPE_NAMES


def _q(x, recipe="fp8_block1x128"):
    return lowprec.quantize(x, recipe)


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv("LOWPREC_BACKEND", "reference")


@pytest.mark.parametrize("b_recipe", RECIPE_NAMES)
def test_gemm_is_matmul_of_dequantized(b_recipe, device):
    g = torch.Generator().manual_seed(0)
    a = _q(torch.randn(37, 384, generator=g).to(device))
    b = lowprec.quantize(torch.randn(80, 384, generator=g).to(device), b_recipe)
    bias = torch.randn(80, generator=g).to(device)
    d = lowprec.gemm(a, b, out_dtype=torch.float32, bias=bias)
    ref = a.dequantize(torch.float64) @ b.dequantize(torch.float64).T + bias.double()
    assert d.dtype == torch.float32 and d.shape == (37, 80)
    assert ((d.double() - ref).norm() / ref.norm()).item() < 1e-6
    d16 = lowprec.gemm(a, b)
    assert d16.dtype == torch.bfloat16
    assert ((d16.double() - ref + bias.double()).norm() / ref.norm()).item() < 1e-2


def test_gemm_errors():
    a = _q(torch.randn(4, 256))
    b = _q(torch.randn(8, 128), "fp8_block128x128")
    with pytest.raises(ValueError, match="K mismatch"):
        lowprec.gemm(a, b)
    b = _q(torch.randn(8, 256), "fp8_block128x128")
    with pytest.raises(TypeError, match="QuantizedTensor"):
        lowprec.gemm(torch.randn(4, 256), b)
    with pytest.raises(ValueError, match="bias"):
        lowprec.gemm(a, b, bias=torch.zeros(7))
    with pytest.raises(TypeError, match="out_dtype"):
        lowprec.gemm(a, b, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="2 dims"):
        lowprec.gemm(_q(torch.randn(2, 4, 256)), b)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64, torch.bool])
def test_gemm_refuses_a_bias_that_is_not_real_floating_point(dtype):
    a = _q(torch.randn(4, 256))
    b = _q(torch.randn(8, 256), "fp8_block128x128")
    bias = (torch.randn(8) + 1j * torch.randn(8)) if dtype.is_complex else torch.ones(8)
    # a complex bias lost its imaginary part in the FP32 cast: a silently wrong output
    with pytest.raises(TypeError, match="bias: expected a real floating-point tensor"):
        lowprec.gemm(a, b, bias=bias.to(dtype))


def test_gemm_takes_every_float_bias_dtype():
    a = _q(torch.randn(4, 256))
    b = _q(torch.randn(8, 256), "fp8_block128x128")
    bias = torch.randn(8, dtype=torch.float64)
    ref = a.dequantize(torch.float64) @ b.dequantize(torch.float64).T
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        d = lowprec.gemm(a, b, out_dtype=torch.float32, bias=bias.to(dtype))
        torch.testing.assert_close(d.double(), ref + bias.to(dtype).double(), rtol=1e-5, atol=1e-5)


def test_grouped_contiguous_matches_per_group_gemm(device):
    g = torch.Generator().manual_seed(1)
    ends = torch.tensor([5, 5, 40, 41, 41, 100], dtype=torch.int32)  # empty groups, a 1-row group
    a = _q(torch.randn(110, 256, generator=g).to(device))
    b = lowprec.quantize(torch.randn(6, 64, 256, generator=g).to(device), "fp8_block128x128")
    d = lowprec.grouped_gemm(a, b, group_ends=ends.to(device), out_dtype=torch.float32)
    a_deq, b_deq = a.dequantize(torch.float64), b.dequantize(torch.float64)
    start = 0
    for e, end in enumerate(ends.tolist()):
        ref = a_deq[start:end] @ b_deq[e].T
        torch.testing.assert_close(d[start:end].double(), ref, rtol=1e-5, atol=1e-5)
        start = end
    assert (d[100:] == 0).all()


def test_grouped_masked(device):
    g = torch.Generator().manual_seed(2)
    counts = torch.tensor([0, 3, 16, 9], dtype=torch.int32)
    a = _q(torch.randn(4, 16, 128, generator=g).to(device))
    b = lowprec.quantize(torch.randn(4, 32, 128, generator=g).to(device), "fp8_block128x128")
    d = lowprec.grouped_gemm(a, b, masked_counts=counts.to(device), out_dtype=torch.float32)
    assert d.shape == (4, 16, 32)
    for e, c in enumerate(counts.tolist()):
        ref = a.dequantize(torch.float64)[e, :c] @ b.dequantize(torch.float64)[e].T
        torch.testing.assert_close(d[e, :c].double(), ref, rtol=1e-5, atol=1e-5)
        assert (d[e, c:] == 0).all()


def test_grouped_errors():
    a = _q(torch.randn(10, 128))
    b = _q(torch.randn(2, 16, 128), "fp8_block128x128")
    with pytest.raises(ValueError, match="exactly one"):
        lowprec.grouped_gemm(a, b)
    with pytest.raises(ValueError, match="non-decreasing"):
        lowprec.grouped_gemm(a, b, group_ends=torch.tensor([6, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        lowprec.grouped_gemm(a, b, group_ends=torch.tensor([4, 11], dtype=torch.int32))
    with pytest.raises(ValueError, match="shape \\(2,\\)"):
        lowprec.grouped_gemm(a, b, group_ends=torch.tensor([10], dtype=torch.int32))
    with pytest.raises(ValueError, match="M_max"):
        lowprec.grouped_gemm(_q(torch.randn(2, 4, 128)), b, masked_counts=torch.tensor([1, 5], dtype=torch.int32))


def test_grouped_takes_int64_groups_and_says_so_when_they_are_wrong():
    a = _q(torch.randn(10, 128))
    a3 = _q(torch.randn(2, 4, 128))
    b = _q(torch.randn(2, 16, 128), "fp8_block128x128")
    ends, counts = torch.tensor([4, 9]), torch.tensor([4, 1])
    assert torch.equal(lowprec.grouped_gemm(a, b, group_ends=ends),
                       lowprec.grouped_gemm(a, b, group_ends=ends.int()))
    assert torch.equal(lowprec.grouped_gemm(a3, b, masked_counts=counts),
                       lowprec.grouped_gemm(a3, b, masked_counts=counts.int()))
    # an int64 tensor of the wrong length: the message must not suggest its dtype is the problem
    with pytest.raises(ValueError, match=r"group_ends: expected an int32 or int64 tensor of shape \(2,\)"):
        lowprec.grouped_gemm(a, b, group_ends=torch.tensor([10]))
    with pytest.raises(ValueError, match=r"masked_counts: expected an int32 or int64 tensor"):
        lowprec.grouped_gemm(a3, b, masked_counts=torch.tensor([1.0, 2.0]))


def _rel(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_gemms_ignore_autocast(dtype):
    g = torch.Generator().manual_seed(0)
    a = lowprec.quantize(torch.randn(40, 256, generator=g), "fp8_block1x128")
    b = lowprec.quantize(torch.randn(48, 256, generator=g), "nvfp4")
    bias = torch.randn(48, generator=g)
    ref = a.dequantize(torch.float64) @ b.dequantize(torch.float64).T + bias.double()
    big = lowprec.quantize(torch.randn(4, 256, generator=g) * 1e5, "fp8_block1x128")  # past fp16's range
    w2 = torch.randn(3, 8, 256, generator=g)
    w = lowprec.quantize(w2, "fp8_block128x128")
    w0 = lowprec.quantize(w2[0], "fp8_block128x128")
    ends = torch.tensor([1, 1, 4], dtype=torch.int32)
    counts = torch.tensor([1, 0, 3], dtype=torch.int32)
    big3 = lowprec.quantize(torch.randn(3, 4, 256, generator=g) * 1e5, "fp8_block1x128")
    x = torch.randn(5, 256, generator=g)
    packed = pack_nvfp4(b.data, b.scale, b.global_scale)
    want = (lowprec.gemm(big, w0, out_dtype=torch.float32),
            lowprec.grouped_gemm(big, w, group_ends=ends, out_dtype=torch.float32),
            lowprec.grouped_gemm(big3, w, masked_counts=counts, out_dtype=torch.float32),
            weight_only_reference(x, packed))
    with torch.autocast("cpu", dtype=dtype):
        assert _rel(lowprec.gemm(a, b, out_dtype=torch.float32, bias=bias), ref) < 1e-6
        got = (lowprec.gemm(big, w0, out_dtype=torch.float32),
               lowprec.grouped_gemm(big, w, group_ends=ends, out_dtype=torch.float32),
               lowprec.grouped_gemm(big3, w, masked_counts=counts, out_dtype=torch.float32),
               weight_only_reference(x, packed))
    for y, expect in zip(got, want):
        assert torch.isfinite(y).all() and torch.equal(y, expect)
