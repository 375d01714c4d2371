"""The quantize custom ops (what torch.compile traces): fake and real outputs agree in shape and
layout, and their values are quantize()'s."""

import pytest
import torch

import lowprec
from lowprec.quant import ops

OPCHECK_TESTS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("recipe", ["fp8_block1x128", "fp8_rowwise", "fp8_block128x128"])
@pytest.mark.parametrize("shape", [(200, 256), (7, 48), (128, 72)])
def test_quantize_op(recipe, shape):
    x = torch.randn(*shape, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.lowprec.quantize_fp8.default, (x, recipe), test_utils=OPCHECK_TESTS)
    q, s = ops.quantize_fp8(x, recipe)
    want = lowprec.quantize(x, recipe)
    assert torch.equal(q.view(torch.uint8), want.data.view(torch.uint8)) and torch.equal(s, want.scale)


@pytest.mark.parametrize("recipe", ["fp8_block1x128", "fp8_rowwise", "fp8_block128x128"])
def test_quantize_op_of_rows_without_columns(recipe):
    """No columns: the op's scales are quantize()'s grid ([M, 0] for rowwise too, not [M, 1])."""
    x = torch.randn(5, 0)
    torch.library.opcheck(torch.ops.lowprec.quantize_fp8.default, (x, recipe), test_utils=OPCHECK_TESTS)
    q, s = ops.quantize_fp8(x, recipe)
    assert q.shape == (5, 0) and s.shape == lowprec.quantize(x, recipe).scale.shape


@pytest.mark.parametrize("t_rows", [1, 16, 128])
@pytest.mark.parametrize("tokens", [200, 7, 128])
def test_dual_op(tokens, t_rows):
    x = torch.randn(tokens, 256)
    torch.library.opcheck(torch.ops.lowprec.quantize_dual_fp8.default, (x, t_rows), test_utils=OPCHECK_TESTS)
    got = ops.quantize_dual_fp8(x, t_rows)
    want = lowprec.quant.quantize_dual(x, "fp8_block1x128", f"fp8_block{t_rows}x128")
    for g, w in zip(got, (want[0].data, want[0].scale, want[1].data, want[1].scale)):
        assert g.shape == w.shape and torch.equal(g.float(), w.float())


@pytest.mark.parametrize("t_rows", [16, 128])
def test_swiglu_dual_op_with_block_transpose(t_rows):
    g, u = torch.randn(200, 256, dtype=torch.bfloat16), torch.randn(200, 256, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.lowprec.swiglu_dual_fp8.default, ("swiglu", [g, u], t_rows),
                          test_utils=OPCHECK_TESTS)
    got = ops.swiglu_dual_fp8("swiglu", [g, u], t_rows)
    want = lowprec.quant.quantize_dual(ops.swiglu_values("swiglu", (g, u)), "fp8_block1x128",
                                       f"fp8_block{t_rows}x128")
    for got_t, want_t in zip(got, (want[0].data, want[0].scale, want[1].data, want[1].scale)):
        assert got_t.shape == want_t.shape and torch.equal(got_t.float(), want_t.float())
    with pytest.raises(ValueError, match="t_rows"):
        ops.swiglu_dual_codes("swiglu_dup", (g, u), t_rows=t_rows)
    with pytest.raises(ValueError, match="t_rows"):
        ops.swiglu_dual_codes("swiglu", (g, u), t_rows=32)


@pytest.mark.parametrize("stack", [(256, 256), (512, 128)])
def test_128x128_transposing_op(stack):
    rows, n = stack  # rows / n matrices of n rows
    x = torch.randn(rows, 192)
    torch.library.opcheck(torch.ops.lowprec.quantize_128x128_t_fp8.default, (x, n), test_utils=OPCHECK_TESTS)
    q, s, qt = ops.quantize_128x128_t_fp8(x, n)
    want, want_t = lowprec.quant.quantize_with_transpose(x.view(rows // n, n, 192))
    assert torch.equal(q.float(), want.data.reshape(rows, 192).float())
    assert torch.equal(s, want.scale.reshape(-1, s.shape[-1]))
    assert torch.equal(qt.float(), want_t.data.reshape(-1, n).float())


def test_compiled_quantize_traces_the_ops_without_graph_breaks():
    """On CPU torch.compile traces the reference (the ops are for CUDA inputs); the ops themselves
    go into a fullgraph trace."""
    x = torch.randn(64, 256)
    fn = torch.compile(lambda t: ops.quantize_fp8(t, "fp8_block1x128"), fullgraph=True, backend="aot_eager")
    q, s = fn(x)
    want = lowprec.quantize(x, "fp8_block1x128")
    assert torch.equal(q.float(), want.data.float()) and torch.equal(s, want.scale)


def test_kernel_constraints_are_stated_by_the_hopper_config():
    """What the sm_90a quantize kernels take, asked with each kernel's own arguments."""
    from lowprec.quant.sm90.config import dual_unsupported, quantize_unsupported, transpose_unsupported

    x = torch.randn(32, 256, dtype=torch.bfloat16)
    r1x128, rowwise = lowprec.get_recipe("fp8_block1x128"), lowprec.get_recipe("fp8_rowwise")
    assert quantize_unsupported(x, rowwise) is None
    assert "no quantize kernel" in quantize_unsupported(x, lowprec.get_recipe("mxfp8"))
    assert "dtype" in quantize_unsupported(x.double(), r1x128)
    assert "multiple of 16" in quantize_unsupported(x[:, :40], r1x128)
    r128 = lowprec.get_recipe("fp8_block128x128")
    assert dual_unsupported(x, r1x128, r1x128) is None
    assert dual_unsupported(x, r1x128, r128) is None  # the transpose in 128x128 blocks
    assert "1x128" in dual_unsupported(x, rowwise, rowwise)  # along features: 1x128 scales only
    assert "recipe_t" in dual_unsupported(x, r1x128, rowwise)
    assert transpose_unsupported(x.reshape(2, 16, 256), r128) is not None  # 16-row matrices in a batch
    assert transpose_unsupported(torch.randn(2, 128, 256), r128) is None


def test_quantize_constraint_of_a_tensor_without_columns():
    """No columns: the constraint says so (it does not fail reshaping the empty view)."""
    from lowprec.quant.sm90.config import quantize_unsupported, transpose_unsupported

    x = torch.zeros(2, 16, 0, dtype=torch.bfloat16)
    assert "no columns" in quantize_unsupported(x, lowprec.get_recipe("fp8_block1x128"))
    assert "no columns" in transpose_unsupported(x, lowprec.get_recipe("fp8_block128x128"))
