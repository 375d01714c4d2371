"""lowprec.blocks: block geometry and dequantization in plain torch (CPU)."""

import pytest
import torch

import lowprec
from lowprec.blocks import expand_scale, times_block_scales
from lowprec.formats import decode, get_format, unpack_fp4


@pytest.mark.parametrize("shape, block", [((256, 512), (1, 128)), ((3, 256, 384), (128, 128)),
                                          ((200, 300), (1, 128)), ((130, 256), (128, 128)), ((64, 96), (64, 96))])
def test_block_scales_broadcast_as_the_expanded_grid(shape, block):
    """Whole blocks (a broadcast view) and tails (the expanded grid) give the expanded grid's products."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(*shape, generator=g)
    rows, cols = shape[-2:]
    grid = torch.rand(*shape[:-2], -(-rows // block[0]), -(-cols // block[1]), generator=g) + 0.5
    expected = q * expand_scale(grid, *block, rows, cols)
    assert torch.equal(times_block_scales(q, grid, *block), expected)
    # a grid without the leading dims (one scale grid for a batch) broadcasts over them
    assert torch.equal(times_block_scales(q, grid[(0,) * (len(shape) - 2)], *block),
                       q * expand_scale(grid[(0,) * (len(shape) - 2)], *block, rows, cols))


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_rowwise", "fp8_block1x128", "fp8_block128x128", "mxfp8"])
def test_dequantize_is_codes_times_scales(recipe):
    """One FP32 scale per block: the FP32 product is the exact product rounded once."""
    x = torch.randn(2, 256, 512, generator=torch.Generator().manual_seed(1)) * 3
    qt = lowprec.quantize(x, recipe)
    exact = qt.dequantize(torch.float64)
    assert torch.equal(qt.dequantize(torch.float32), exact.float())  # every product fits FP32
    assert torch.equal(qt.dequantize(torch.bfloat16), exact.float().bfloat16())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name, opts", [("mxfp8", {}), ("mxfp4", {}), ("fp8_block1x128", {"pow2_scale": True})])
def test_finite_values_near_the_dtype_max_dequantize_finite(dtype, name, opts):
    """E8M0 / pow2 scales round the block's amax up (fp16 65504 -> 256 · 2^8): the dequantized
    value in the input's dtype saturates to its largest finite value instead of becoming Inf."""
    big = torch.finfo(dtype).max
    x = torch.tensor([[big, -big, 1.0, 0.0] * 8], dtype=dtype) * (0.97 if dtype == torch.float32 else 1)
    deq = lowprec.quantize(x, name, **opts).dequantize()
    assert deq.dtype == dtype and torch.isfinite(deq).all()
    assert (deq[0, 0] >= 0.9 * x[0, 0]) and (deq[0, 1] <= 0.9 * x[0, 1])
    exact = lowprec.quantize(x, name, **opts).dequantize(torch.float64)
    assert torch.isfinite(exact).all()  # the float64 dequantization is left exact (not clamped)


@pytest.mark.parametrize("weight_2d", [False, True])
def test_nvfp4_float64_dequantize_is_exact(weight_2d):
    """dequantize(float64) is the exact error reference: the E4M3 block scale times the FP32 global
    scale must not be rounded to FP32 first."""
    torch.manual_seed(0)
    q = lowprec.quantize(torch.randn(64, 128), "nvfp4", weight_2d=weight_2d)
    codes = decode(unpack_fp4(q.data), get_format("e2m1"), check_range=False).double()
    scale = q.scale.double()
    if weight_2d:
        scale = scale.repeat_interleave(16, 0)
    exact = codes * scale.repeat_interleave(16, 1) * q.global_scale.double()
    assert torch.equal(q.dequantize(torch.float64), exact)


def test_float32_dequantize_unchanged():
    """The FP32 path keeps its products (scale * global in FP32, then times the code)."""
    torch.manual_seed(1)
    q = lowprec.quantize(torch.randn(32, 64), "nvfp4")
    codes = decode(unpack_fp4(q.data), get_format("e2m1"), check_range=False)
    want = codes * (q.scale.float() * q.global_scale).repeat_interleave(16, 1)
    assert torch.equal(q.dequantize(torch.float32), want)
