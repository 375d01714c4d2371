"""The MoE custom ops (what torch.compile traces for a call without gradients): fake and real
agree, and compiled layers give the eager result bit for bit with no graph break."""

import pytest
import torch

from lowprec.moe import FP8InferenceMoE, MoE, experts
from lowprec.moe.ops import moe_experts, moe_layer

H, FFN, E, K, T = 64, 64, 8, 2, 40


def _layers():
    torch.manual_seed(0)
    moe = MoE(H, FFN, E, K, capacity_factor=1.0)
    return moe, FP8InferenceMoE.from_moe(moe)


def test_opcheck_fake_and_dynamic():
    moe, inf = _layers()
    w1, w2 = inf.quantized_weights()
    x = torch.randn(T, H)
    weights, ids = torch.rand(T, K).softmax(-1), torch.randint(0, E, (T, K))
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(moe_experts, (x, weights, ids, w1.data, w1.scale, w2.data, w2.scale, "fp8_block", 1.0,
                                        "probs", "swiglu", True), test_utils=utils)
    torch.library.opcheck(moe_experts, (x, weights, ids, moe.w1.detach(), None, moe.w2.detach(), None, None, None,
                                        "position", "geglu", True), test_utils=utils)
    torch.library.opcheck(moe_layer, (x, inf.router.weight.detach(), w1.data, w1.scale, w2.data, w2.scale,
                                      "fp8_block", K, "sigmoid", False, 0.5, "position", "swiglu"), test_utils=utils)


@pytest.mark.parametrize("inference", [False, True], ids=["MoE", "FP8InferenceMoE"])
def test_compiled_inference_is_one_graph_with_the_eager_result(inference):
    moe, inf = _layers()
    layer = inf if inference else moe
    model = torch.nn.Sequential(torch.nn.Linear(H, H), layer)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    with torch.no_grad():
        for shape in ((T, H), (3, 16, H)):
            x = torch.randn(shape)
            assert torch.equal(compiled(x), model(x))


def test_compiled_functional_experts_matches_eager():
    _, inf = _layers()
    w1, w2 = inf.quantized_weights()

    def f(x, weights, ids):
        return experts(x, weights, ids, w1, w2, capacity_factor=1.0)

    x = torch.randn(T, H)
    weights, ids = torch.rand(T, K).softmax(-1), torch.randint(0, E, (T, K))
    with torch.no_grad():
        assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(x, weights, ids), f(x, weights, ids))


def test_compiled_training_keeps_the_autograd_path():
    """With gradients to come the layer is not the op (it has no backward): it runs as before and
    its gradients equal eager's."""
    moe, _ = _layers()
    x = torch.randn(T, H)
    grads = []
    for run in (moe, torch.compile(moe, backend="aot_eager")):
        xl = x.clone().requires_grad_()
        run(xl).square().sum().backward()
        grads.append([xl.grad] + [p.grad.clone() for p in moe.parameters()])
        moe.zero_grad()
    for got, want in zip(*grads):
        assert torch.equal(got, want)
