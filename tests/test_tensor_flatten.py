"""QuantizedTensor's flatten protocol: the one way to take it apart and rebuild it."""

import pytest
import torch

import lowprec
from lowprec.tensor import QuantizedTensor, flatten_all, unflatten_all


@pytest.mark.parametrize("recipe", ["fp8_block1x128", "nvfp4", "mxfp8"])
def test_flatten_roundtrip(recipe):
    q = lowprec.quantize(torch.randn(4, 64), recipe)
    tensors, meta = q.flatten()
    assert len(tensors) == (3 if q.global_scale is not None else 2)
    back = QuantizedTensor.unflatten(tensors, meta)
    assert back.recipe == q.recipe and back.shape == q.shape and back.dtype == q.dtype
    assert torch.equal(back.dequantize(torch.float64), q.dequantize(torch.float64))


def test_flatten_all_mixes_tensors_quantized_and_none():
    x = torch.randn(3)
    q = lowprec.quantize(torch.randn(4, 32), "nvfp4")
    tensors, specs = flatten_all(x, None, q)
    assert all(isinstance(t, torch.Tensor) for t in tensors) and len(tensors) == 4
    x2, none, q2 = unflatten_all(tuple(tensors), specs)
    assert x2 is x and none is None
    assert torch.equal(q2.global_scale, q.global_scale) and torch.equal(q2.data, q.data)
