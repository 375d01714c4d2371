"""QuantizedBuffersModule: what the inference layers derive from their buffers follows the buffers."""

import gc
import weakref

import pytest
import torch

from lowprec.moe import MoE, NVFP4InferenceMoE
from lowprec.nn import FP8InferenceLinear, NVFP4InferenceLinear


@pytest.mark.parametrize("kind", ["nvfp4_linear", "nvfp4_moe", "fp8_linear"])
def test_a_module_move_frees_the_old_devices_tensors(kind):
    """Caches derived from the buffers (packed weights, views) are dropped by a module move: the
    old device's tensors are freed (was: held by the cache, so model.cpu() left the weights on the
    GPU); "meta" stands for the other device."""
    torch.manual_seed(0)
    if kind == "nvfp4_linear":
        layer = NVFP4InferenceLinear.from_linear(torch.nn.Linear(256, 256))
        x = torch.randn(4, 256, dtype=torch.bfloat16)
    elif kind == "nvfp4_moe":
        layer, x = NVFP4InferenceMoE.from_moe(MoE(128, 128, 4, 2)), torch.randn(4, 128, dtype=torch.bfloat16)
    else:
        layer, x = FP8InferenceLinear.from_linear(torch.nn.Linear(256, 256)), torch.randn(4, 256)
    with torch.no_grad():
        layer(x)
    old = [weakref.ref(t) for t in layer.buffers()]
    if kind == "fp8_linear":  # the weight-only operand (packed by a CUDA forward)
        old.append(weakref.ref(layer.packed_weight().data))
    layer.to("meta")
    gc.collect()
    assert not [r() for r in old if r() is not None]
