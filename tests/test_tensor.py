import pytest
import torch

import lowprec


@pytest.mark.parametrize("recipe", ["fp8_block128x128", "fp8_tensorwise"])
@pytest.mark.parametrize("shape", [(200, 136), (3, 200, 136)])
def test_transpose_equals_quantizing_the_transpose(recipe, shape):
    x = torch.randn(*shape) * torch.exp(torch.randn(*shape[:-1], 1))
    qt = lowprec.quantize(x, recipe)
    assert qt.transposable
    t = qt.transpose()
    ref = lowprec.quantize(x.transpose(-1, -2), recipe)
    assert t.shape == ref.shape
    assert torch.equal(t.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(t.scale, ref.scale)


@pytest.mark.parametrize("recipe", ["fp8_block1x128", "fp8_rowwise", "mxfp8", "nvfp4"])
def test_transpose_refuses_non_square_blocks(recipe):
    qt = lowprec.quantize(torch.randn(32, 64), recipe)
    assert not qt.transposable
    with pytest.raises(ValueError, match="requantize"):
        qt.transpose()
