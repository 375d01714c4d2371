import numpy as np
import pytest
import torch

import lowprec
from lowprec.quant import quantize_dual


@pytest.mark.parametrize("shape", [(1, 128), (37, 256), (3, 50, 384), (160, 96)])
def test_dual_is_both_orientations(shape, device):
    x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
    rows_q, cols_q = quantize_dual(x)
    x2 = x.reshape(-1, shape[-1])
    t = x2.shape[0]
    t_pad = -(-t // 16) * 16
    assert rows_q.shape == x2.shape and cols_q.shape == (shape[-1], t_pad)
    ref_rows = lowprec.quantize(x2, "fp8_block1x128")
    assert torch.equal(rows_q.data.view(torch.uint8), ref_rows.data.view(torch.uint8))
    assert torch.equal(rows_q.scale, ref_rows.scale)
    ref_cols = lowprec.quantize(x2.t(), "fp8_block1x128").dequantize(torch.float32)
    deq = cols_q.dequantize(torch.float32)
    assert torch.equal(deq[:, :t], ref_cols) and (deq[:, t:] == 0).all()


@pytest.mark.parametrize("shape", [(1, 128), (37, 256), (3, 50, 384), (300, 96)])
def test_dual_transpose_in_square_blocks(shape, device):
    """``recipe_t="fp8_block128x128"``: the transposed half is the padded transpose quantized in
    128x128 blocks (one scale per 128 features x 128 tokens), the other half unchanged."""
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g))).to(device,
                                                                                                  torch.bfloat16)
    rows_q, cols_q = quantize_dual(x, "fp8_block1x128", "fp8_block128x128")
    x2 = x.reshape(-1, shape[-1])
    t_pad = -(-x2.shape[0] // 16) * 16
    padded = torch.nn.functional.pad(x2, (0, 0, 0, t_pad - x2.shape[0]))
    ref_rows, ref_cols = lowprec.quantize(x2, "fp8_block1x128"), lowprec.quantize(padded.t(), "fp8_block128x128")
    assert cols_q.recipe.name == "fp8_block128x128" and cols_q.shape == (shape[-1], t_pad)
    assert cols_q.scale.shape == (-(-shape[-1] // 128), -(-t_pad // 128))
    for got, want in ((rows_q, ref_rows), (cols_q, ref_cols)):
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale, want.scale)


def test_dual_other_recipes_and_errors():
    x = torch.randn(20, 64)
    rows_q, cols_q = quantize_dual(x, "fp8_rowwise")
    assert rows_q.scale.shape == (20, 1) and cols_q.shape == (64, 32) and cols_q.scale.shape == (64, 1)
    with pytest.raises(ValueError, match="≥ 2 dims"):
        quantize_dual(torch.randn(16))
    with pytest.raises(ValueError, match="recipe_t: expected the element format"):
        quantize_dual(x, "fp8_block1x128", "mxfp4")
    g = torch.randn(20, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="recipe_t: expected one of .*fp8_block16x128"):
        lowprec.quant.swiglu_quantize_dual("swiglu", g, g, recipe_t="fp8_rowwise")


@pytest.mark.parametrize("call", [
    lambda: quantize_dual(torch.randn(16, 128), "fp8_block1x128", "fp8_block1x64"),
    lambda: lowprec.quant.swiglu_quantize_dual("swiglu", *(torch.randn(16, 128, dtype=torch.bfloat16),) * 2,
                                               recipe_t="fp8_block1x64"),
])
def test_unknown_recipe_t_names_recipe_t(call):
    """The error names the argument that was wrong (recipe_t), not recipe."""
    with pytest.raises(ValueError, match="^recipe_t: unknown recipe 'fp8_block1x64'"):
        call()


def test_swiglu_quantize_dual_rejects_an_unknown_kind_and_wrong_inputs():
    g, u, da = (torch.randn(32, 256, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(ValueError, match="kind"):
        lowprec.quant.swiglu_quantize_dual("swiglu_dgrad", g, u, da)
    with pytest.raises(ValueError, match="inputs"):
        lowprec.quant.swiglu_quantize_dual("swiglu", g, u, da)
    with pytest.raises(ValueError, match="inputs"):
        lowprec.quant.swiglu_quantize_dual("swiglu", g, u[:1])


@pytest.mark.parametrize("x", [np.ones((16, 128), dtype=np.float32), [[1.0] * 128] * 16])
def test_quantize_dual_names_x_for_a_non_tensor(x):
    with pytest.raises(ValueError, match="x: expected a float tensor with ≥ 2 dims"):
        quantize_dual(x)


def test_quantize_dual_compiles_with_dynamic_shapes():
    torch._dynamo.reset()
    f = torch.compile(lambda x: lowprec.quant.quantize_dual(x, "fp8_block1x128", "fp8_block16x128"),
                      fullgraph=True, backend="aot_eager", dynamic=True)
    for rows in (33, 47):
        x = torch.randn(rows, 256)
        got, want = f(x), lowprec.quant.quantize_dual(x, "fp8_block1x128", "fp8_block16x128")
        for g, w in zip(got, want):
            assert g.shape == w.shape and torch.equal(g.data.float(), w.data.float()) and torch.equal(g.scale, w.scale)


@pytest.mark.parametrize("recipe_t", ["fp8_block16x128", "fp8_block128x128"])
@pytest.mark.parametrize("kind,n", [("swiglu_dgate", 3), ("swiglu_dup", 2)])
def test_gradient_kinds_name_recipe_t(kind, n, recipe_t):
    from lowprec.quant import swiglu_quantize_dual

    inputs = [torch.randn(16, 128, dtype=torch.bfloat16) for _ in range(n)]
    with pytest.raises(ValueError, match="^recipe_t: .*swiglu"):
        swiglu_quantize_dual(kind, *inputs, recipe_t=recipe_t)


def test_activation_kind_still_takes_2d_blocks():
    from lowprec.quant import swiglu_quantize_dual

    g, u = (torch.randn(16, 128, dtype=torch.bfloat16) for _ in range(2))
    a, b = swiglu_quantize_dual("swiglu", g, u, recipe_t="fp8_block16x128")
    assert b.recipe.name == "fp8_block16x128" and b.shape == (128, 16)
