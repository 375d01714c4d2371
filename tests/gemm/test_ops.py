"""The GEMM custom op: torch.compile traces it without graph breaks; fake and real agree."""

import pytest
import torch

import lowprec
from lowprec.gemm.reference import gemm_reference
from lowprec.gemm.sm90.config import gemm_unsupported
from lowprec.gemm.sm90.interface import _blockwise_scales
from lowprec.recipes import RECIPE_NAMES, ScaleRecipe, get_recipe
from lowprec.tensor import QuantizedTensor


def test_recipe_spec_roundtrip():
    for name in RECIPE_NAMES:
        r = get_recipe(name)
        assert ScaleRecipe.from_spec(r.spec()) == r


def test_opcheck_fake_and_dynamic():
    a = lowprec.quantize(torch.randn(47, 256), "fp8_block1x128")
    b = lowprec.quantize(torch.randn(64, 256), "nvfp4")
    args = (a.data, a.scale, None, a.recipe.spec(), b.data, b.scale, b.global_scale, b.recipe.spec(), 256,
            torch.randn(64), torch.float32)
    torch.library.opcheck(torch.ops.lowprec.gemm.default, args,
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_kernel_eligibility():
    a = lowprec.quantize(torch.randn(8, 256), "fp8_block1x128")
    w = lowprec.quantize(torch.randn(64, 256), "fp8_block128x128")
    bf16 = torch.bfloat16
    assert gemm_unsupported(a, w, bf16, None) is None
    assert gemm_unsupported(lowprec.quantize(torch.randn(8, 256), "fp8_rowwise"), w, bf16, None) is None
    assert "M=0" in gemm_unsupported(lowprec.quantize(torch.randn(0, 256), "fp8_block1x128"), w, bf16, None)
    assert "mxfp8" in gemm_unsupported(lowprec.quantize(torch.randn(8, 256), "mxfp8"), w, bf16, None)
    assert "activations" in gemm_unsupported(lowprec.quantize(torch.randn(8, 256), "fp8_block128x128"), w, bf16, None)
    w_odd = lowprec.quantize(torch.randn(40, 256), "fp8_block128x128")
    assert "multiples of 16" in gemm_unsupported(a, w_odd, bf16, None)
    assert "bias" in gemm_unsupported(a, w, bf16, torch.zeros(64, dtype=torch.float16))


def test_empty_m(device):
    a = lowprec.quantize(torch.randn(0, 256, device=device), "fp8_block1x128")
    w = lowprec.quantize(torch.randn(64, 256, device=device), "fp8_block128x128")
    assert lowprec.gemm(a, w).shape == (0, 64)


def test_compile_fullgraph_matches_eager():
    def f(x, w):
        return lowprec.gemm(lowprec.quantize(x, "fp8_block1x128", check_finite=False), w, out_dtype=torch.float32)

    w = lowprec.quantize(torch.randn(64, 256), "fp8_block128x128")
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for rows in (33, 47):
        x = torch.randn(rows, 256)
        assert torch.equal(compiled(x, w), f(x, w))


@pytest.mark.parametrize("ra,rb", [("fp8_rowwise", "fp8_rowwise"), ("fp8_tensorwise", "fp8_tensorwise"),
                                   ("fp8_block1x128", "fp8_tensorwise"), ("fp8_rowwise", "fp8_block128x128")])
def test_rowwise_and_tensorwise_recast_to_kernel_scales_exactly(ra, rb):
    """The kernel takes 1x128 / 128x128 scale grids; other FP32-scaled recipes are repeated into them."""
    a = lowprec.quantize(torch.randn(40, 300), ra)
    b = lowprec.quantize(torch.randn(272, 300), rb)
    sa, sb = _blockwise_scales(a, b)
    assert sa.shape == (40, 3) and sb.shape in ((272, 3), (3, 3))
    a2 = QuantizedTensor(a.data, sa, get_recipe("fp8_block1x128"), a.shape, a.dtype)
    b2 = QuantizedTensor(b.data, sb, get_recipe("fp8_block1x128" if sb.shape[0] == 272 else "fp8_block128x128"),
                         b.shape, b.dtype)
    assert torch.equal(gemm_reference(a, b, torch.float32, None), gemm_reference(a2, b2, torch.float32, None))


@pytest.mark.gpu
def test_kernel_takes_fp8_codes_of_any_strides(monkeypatch):
    """Inductor may lay out the traced quantization's codes column-major (strides (1, M)): the op
    hands the kernel K-major codes (LOWPREC_BACKEND=kernel: no fallback) with the same result."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    a = lowprec.quantize(torch.randn(200, 256, device="cuda"), "fp8_block1x128")
    b = lowprec.quantize(torch.randn(128, 256, device="cuda"), "fp8_block128x128")
    want = lowprec.gemm(a, b)
    a_t = QuantizedTensor(a.data.t().contiguous().t(), a.scale, a.recipe, a.shape, a.dtype)
    b_t = QuantizedTensor(b.data.t().contiguous().t(), b.scale, b.recipe, b.shape, b.dtype)
    assert a_t.data.stride() == (1, 200)
    assert torch.equal(lowprec.gemm(a_t, b_t), want)


def test_compiled_gemm_survives_a_recompile_for_another_block_size():
    """One compiled call site, a 128x128 then a 16x128 weight: the recompile makes the block size a
    SymInt, which the recipe's spec string (the custom op's argument) must not format."""
    def f(a, b):
        return lowprec.gemm(a, b, out_dtype=torch.float32)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    a = lowprec.quantize(torch.randn(32, 256), "fp8_block1x128")
    for recipe in ("fp8_block128x128", "fp8_block16x128"):
        b = lowprec.quantize(torch.randn(64, 256), recipe)
        assert torch.equal(compiled(a, b), f(a, b))


def test_an_empty_n_or_k_is_not_the_dense_kernels():
    """The dense kernel's K loop needs a block: N = 0 or K = 0 go to the reference (zeros)."""
    bf16 = torch.bfloat16
    a0 = lowprec.quantize(torch.randn(8, 0), "fp8_block1x128")
    w0 = lowprec.quantize(torch.randn(256, 0), "fp8_block128x128")
    assert "empty dimension" in gemm_unsupported(a0, w0, bf16, None)
    a = lowprec.quantize(torch.randn(8, 128), "fp8_block1x128")
    assert "empty dimension" in gemm_unsupported(a, lowprec.quantize(torch.randn(0, 128), "fp8_block128x128"),
                                                 bf16, None)
    assert torch.equal(lowprec.gemm(a0, w0), torch.zeros(8, 256))


def test_compiled_gemm_takes_a_recipe_named_with_a_colon():
    """The compiled gemm passes recipes through spec() / from_spec(); a custom name may hold ':'."""
    r = ScaleRecipe("team:mx8", (1, 32), "e4m3", "e8m0", "rceil")
    a, b = lowprec.quantize(torch.randn(16, 64), r), lowprec.quantize(torch.randn(32, 64), r)
    f = torch.compile(lambda a, b: lowprec.gemm(a, b), backend="eager", fullgraph=True)
    torch.testing.assert_close(f(a, b), lowprec.gemm(a, b))


@pytest.mark.parametrize("out_dtype,bias_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16)])
def test_gemm_bias_gradient_compiled_equals_eager(out_dtype, bias_dtype):
    a = lowprec.quantize(torch.randn(8, 128), "fp8_block1x128")
    w = lowprec.quantize(torch.randn(32, 128), "fp8_block128x128")
    bias = torch.randn(32, dtype=bias_dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.lowprec.gemm.default,
                          (a.data, a.scale, None, a.recipe.spec(), w.data, w.scale, None, w.recipe.spec(), 128, bias,
                           out_dtype), test_utils=("test_autograd_registration", "test_aot_dispatch_dynamic"))

    def f(bias):
        return lowprec.gemm(a, w, out_dtype=out_dtype, bias=bias)

    dy = torch.randn(8, 32, dtype=out_dtype)
    (want,) = torch.autograd.grad(f(bias), bias, dy)
    (got,) = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(bias), bias, dy)
    assert got.dtype == bias_dtype and torch.equal(got, want)


@pytest.mark.gpu
def test_eager_gemm_bias_gradient_on_the_gpu():
    """On CUDA the eager call runs the kernel, whose output has no graph: the bias still gets its
    gradient (the output gradient summed over rows), as on the reference path."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    a = lowprec.quantize(torch.randn(200, 256, device="cuda"), "fp8_block1x128")
    w = lowprec.quantize(torch.randn(128, 256, device="cuda"), "fp8_block128x128")
    bias = torch.randn(128, device="cuda", requires_grad=True)
    y = lowprec.gemm(a, w, bias=bias)
    with torch.no_grad():
        assert torch.equal(y, lowprec.gemm(a, w, bias=bias))  # the same output as without a graph
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.equal(bias.grad, dy.float().sum(0))


def _operands_with_scales_that_require_grad():
    torch.manual_seed(0)
    a = lowprec.quantize(torch.randn(4, 128), "fp8_rowwise")
    b = lowprec.quantize(torch.randn(8, 128), "nvfp4")
    scale = a.scale.clone().requires_grad_()
    g = b.global_scale.clone().requires_grad_()
    return (QuantizedTensor(a.data, scale, a.recipe, a.shape, a.dtype),
            QuantizedTensor(b.data, b.scale, b.recipe, b.shape, b.dtype, g), a, b)


def test_quantized_operands_get_no_gradient_eagerly():
    """The docstring: the bias is the only differentiable input; as the op path and the kernels."""
    qa, qb, a, b = _operands_with_scales_that_require_grad()
    y = lowprec.gemm(qa, qb, out_dtype=torch.float32)
    assert not y.requires_grad
    assert torch.equal(y, lowprec.gemm(a, b, out_dtype=torch.float32))


def test_bias_gradient_unchanged():
    qa, qb, a, b = _operands_with_scales_that_require_grad()
    bias = torch.randn(8, requires_grad=True)
    y = lowprec.gemm(qa, qb, out_dtype=torch.float32, bias=bias)
    dy = torch.randn_like(y)
    (db,) = torch.autograd.grad(y, bias, dy)
    assert torch.equal(db, dy.sum(0))
