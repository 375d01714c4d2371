"""The MoE custom ops (what torch.compile traces): fake and real agree, and compiled layers give
the eager result and gradients bit for bit with no graph break."""

import pytest
import torch

from lowprec.moe import FP8InferenceMoE, MoE, experts
from lowprec.moe.ops import moe_experts, moe_experts_backward, moe_experts_train, moe_layer
from lowprec.quant import quantize_with_transpose

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


@pytest.mark.parametrize("recipe", ["fp8_block", None])
def test_opcheck_training_ops(recipe):
    """The training forward and backward ops, quantized or not, every subset of gradients."""
    moe, _ = _layers()
    x = torch.randn(T, H)
    weights, ids = torch.rand(T, K).softmax(-1), torch.randint(0, E, (T, K))
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    w1, w2 = moe.w1.detach(), moe.w2.detach()
    if recipe:
        w1q, w1t = quantize_with_transpose(w1)
        w2q, w2t = quantize_with_transpose(w2)
        fwd_w, bwd_w = (w1q.data, w1q.scale, w2q.data, w2q.scale), (w1t.data, w1t.scale, w2t.data, w2t.scale)
    else:
        fwd_w, bwd_w = (w1, None, w2, None), (w1, None, w2, None)
    args = (x, weights, ids, *fwd_w, recipe, 0.75, "probs", "geglu", True)
    torch.library.opcheck(moe_experts_train, args, test_utils=utils)
    outs = moe_experts_train(*args)
    saved = outs[7:] if recipe else (x, None, outs[7], None)
    dy = torch.randn(T, H)
    for needs in ([True] * 4, [True, False, False, True], [False, True, True, False]):
        torch.library.opcheck(moe_experts_backward, (dy, weights, ids, outs[1:7], *saved, *bwd_w, "geglu",
                                                     torch.float32, torch.float32, needs), test_utils=utils)


def _grads(run, layer, x):
    xl = x.clone().requires_grad_()
    y = run(xl)
    y.square().sum().backward()
    out = [y.detach(), xl.grad] + [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    return out


@pytest.mark.parametrize("recipe", ["fp8_block", None])
def test_compiled_training_is_one_graph_with_the_eager_gradients(recipe):
    """With gradients to come the layer traces as an autograd function over the training ops
    (fullgraph holds); outputs and all gradients equal eager's."""
    torch.manual_seed(0)
    moe = MoE(H, FFN, E, K, capacity_factor=1.0, recipe=recipe, score_func="sigmoid")
    model = torch.nn.Sequential(torch.nn.Linear(H, H), moe)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for shape in ((T, H), (3, 16, H)):
        x = torch.randn(shape)
        for got, want in zip(_grads(compiled, model, x), _grads(model, model, x)):
            assert torch.equal(got, want)


def test_compiled_functional_training_matches_eager():
    """experts() with FP8 weights (no gradient for them) and with float weights frozen or not."""
    moe, inf = _layers()
    x = torch.randn(T, H)
    weights, ids = torch.rand(T, K).softmax(-1), torch.randint(0, E, (T, K))
    w1q, w2q = inf.quantized_weights()
    for w1, w2, train_w in ((w1q, w2q, False), (moe.w1, moe.w2, True), (moe.w1, moe.w2, False)):
        moe.w1.requires_grad_(train_w)
        moe.w2.requires_grad_(train_w)

        def f(x, weights, w1=w1, w2=w2):
            return experts(x, weights, ids, w1, w2, capacity_factor=0.5, drop_policy="position")

        results = []
        for run in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
            xl, wl = x.clone().requires_grad_(), weights.clone().requires_grad_()
            y = run(xl, wl)
            results.append([y, *torch.autograd.grad(y.square().sum(), [xl, wl, *([w1, w2] if train_w else [])])])
        for got, want in zip(*results):
            assert torch.equal(got, want)
    moe.requires_grad_(True)
