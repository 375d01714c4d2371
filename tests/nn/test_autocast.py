"""FP8 layers follow torch.autocast as nn.Linear does: inside it the output has the autocast dtype
and gradients come back in each input's dtype; outside it nothing changes."""

import pytest
import torch

import lowprec
from lowprec.nn import FP8InferenceLinear, FP8Linear, FP8SwiGLUMLP, NVFP4InferenceLinear, SwiGLUMLP


def _layer(weight_dtype, seed=0):
    torch.manual_seed(seed)
    return FP8Linear(256, 128, bias=True, dtype=weight_dtype)


def _step(layer, x, autocast: bool):
    x = x.clone().requires_grad_()
    layer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    y.float().square().sum().backward()
    return y, x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_inside_autocast_output_is_bf16_and_grads_keep_each_dtype(weight_dtype):
    layer = _layer(weight_dtype)
    x = torch.randn(4, 32, 256)
    y, dx, dw, db = _step(layer, x, autocast=True)
    assert y.dtype == torch.bfloat16
    assert dx.dtype == torch.float32 and dw.dtype == weight_dtype and db.dtype == weight_dtype
    # the same as feeding the layer bf16 activations outside autocast, bit for bit
    y_ref, dx_ref, dw_ref, db_ref = _step(layer, x.bfloat16(), autocast=False)
    assert torch.equal(y, y_ref)
    assert torch.equal(dx, dx_ref.float()) and torch.equal(dw, dw_ref) and torch.equal(db, db_ref)


def test_outside_autocast_nothing_changes():
    layer = _layer(torch.float32)
    y, dx, dw, _ = _step(layer, torch.randn(8, 256), autocast=False)
    assert y.dtype == dx.dtype == dw.dtype == torch.float32


def test_nn_linear_agrees_on_the_dtypes():
    """The reference behaviour: nn.Linear under CPU autocast."""
    lin = torch.nn.Linear(256, 128)
    x = torch.randn(8, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == lin.weight.grad.dtype == torch.float32


def test_compiled_under_autocast_equals_eager():
    layer = _layer(torch.float32)
    x = torch.randn(16, 256)
    eager = _step(layer, x, autocast=True)
    compiled_layer = torch.compile(layer, backend="aot_eager", fullgraph=True)
    compiled = _step(compiled_layer, x, autocast=True)
    for a, b in zip(eager, compiled):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_inference_linear_follows_autocast():
    layer = FP8InferenceLinear.from_linear(torch.nn.Linear(256, 128))
    x = torch.randn(8, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, layer(x.bfloat16()))
    assert layer(x).dtype == torch.float32


def test_moe_follows_autocast_and_keeps_its_router_fp32():
    torch.manual_seed(0)
    moe = lowprec.moe.MoE(128, 64, num_experts=4, top_k=2)
    x = torch.randn(16, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, routing = moe(x, return_routing=True)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.float32 and moe.w1.grad.dtype == torch.float32
    y_ref, routing_ref = moe(x.detach().bfloat16(), return_routing=True)
    assert torch.equal(routing.topk_ids, routing_ref.topk_ids)  # FP32 router logits either way
    assert torch.equal(y, y_ref)


LAYERS = {
    "FP8Linear": lambda: FP8Linear(64, 32),
    "FP8InferenceLinear": lambda: FP8InferenceLinear(64, 32),
    "NVFP4InferenceLinear": lambda: NVFP4InferenceLinear(64, 32),
    "FP8SwiGLUMLP": lambda: FP8SwiGLUMLP.from_mlp(SwiGLUMLP(64, 32)),
}


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_forward_gives_the_shape(name, dtype):
    """As nn.Linear: a meta-device layer on a meta input gives the output's shape and dtype."""
    layer = LAYERS[name]().to("meta")
    out = 64 if name == "FP8SwiGLUMLP" else 32
    x = torch.empty(2, 5, 64, device="meta", dtype=dtype, requires_grad=True)
    y = layer(x)
    assert y.device.type == "meta" and y.shape == (2, 5, out) and y.dtype == dtype
    y.sum().backward()
    assert x.grad.shape == x.shape
