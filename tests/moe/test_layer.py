import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import lowprec
from lowprec.metrics import cos_sim, rel_l2
from lowprec.moe import FP8InferenceMoE, MoE, dispatch, experts, route

T, H, FFN, E, K = 96, 128, 64, 4, 2


def reference_experts(x, weights, ids, kept, w1, w2, activation="swiglu"):
    """Loop over experts in x's dtype (float64 here): y[t] = Σ_j w[t, j] · FFN_e(x[t]) over kept slots."""
    gate_fn = F.silu if activation == "swiglu" else F.gelu
    y = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        t_idx, j_idx = ((ids == e) & kept).nonzero(as_tuple=True)
        h = x[t_idx] @ w1[e].T
        gate, up = h.chunk(2, dim=-1)
        o = (gate_fn(gate) * up) @ w2[e].T
        y = y.index_add(0, t_idx, o * weights[t_idx, j_idx, None])
    return y


def emulated_fp8_experts(x, weights, ids, kept, w1, w2):
    """The FP8 recipe emulated in float64: quantize -> dequantize each GEMM operand where the layer does."""
    def fp8(t, recipe="fp8_block1x128"):
        return lowprec.quantize(t, recipe).dequantize(torch.float64)

    w1q, w2q = fp8(w1, "fp8_block128x128"), fp8(w2, "fp8_block128x128")
    y = torch.zeros_like(x, dtype=torch.float64)
    for e in range(w1.shape[0]):
        t_idx, j_idx = ((ids == e) & kept).nonzero(as_tuple=True)
        gate, up = (fp8(x[t_idx]) @ w1q[e].T).chunk(2, dim=-1)
        a = F.silu(gate) * up * weights[t_idx, j_idx, None].double()  # the routing weight scales A
        y = y.index_add(0, t_idx, fp8(a) @ w2q[e].T)
    return y


def make_inputs(seed=0, tokens=T, capacity_factor=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    logits = torch.randn(tokens, E, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(K, dim=-1)
    w1 = torch.randn(E, 2 * FFN, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, FFN, generator=g) / FFN**0.5
    kept = dispatch(weights, ids, E, capacity_factor=capacity_factor).kept
    return x, weights, ids, w1, w2, kept


def run_both(recipe, capacity_factor=None, activation="swiglu", seed=0):
    """(outputs, grads) of lowprec and of the float64 reference, for the same dy."""
    x, weights, ids, w1, w2, kept = make_inputs(seed, capacity_factor=capacity_factor)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 100))
    leaves = [t.clone().requires_grad_() for t in (x, weights, w1, w2)]
    y = experts(leaves[0], leaves[1], ids, leaves[2], leaves[3], recipe=recipe, capacity_factor=capacity_factor,
                activation=activation)
    y.backward(dy)
    ref_leaves = [t.double().requires_grad_() for t in (x, weights, w1, w2)]
    ref = reference_experts(ref_leaves[0], ref_leaves[1], ids, kept, ref_leaves[2], ref_leaves[3], activation)
    ref.backward(dy.double())
    return y, ref, [t.grad for t in leaves], [t.grad for t in ref_leaves]


@pytest.mark.parametrize("capacity_factor", [None, 0.6])
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_unquantized_matches_reference(capacity_factor, activation):
    y, ref, grads, ref_grads = run_both(None, capacity_factor, activation)
    assert y.dtype == torch.float32
    assert rel_l2(y, ref) < 1e-5
    for name, g, rg in zip(("x", "weights", "w1", "w2"), grads, ref_grads):
        assert g.dtype == torch.float32, name
        assert rel_l2(g, rg) < 1e-5, name


@pytest.mark.parametrize("capacity_factor", [None, 0.6])
def test_fp8_matches_reference(capacity_factor):
    y, ref, grads, ref_grads = run_both("fp8_block", capacity_factor)
    y_plain = run_both(None, capacity_factor)[0]
    # two chained FP8 GEMMs: ~6% (one FP8 GEMM on N(0, 1) data is ~3.7%)
    assert rel_l2(y, ref) < 8e-2
    assert rel_l2(y, y_plain) > 1e-2  # really quantized
    x, weights, ids, w1, w2, kept = make_inputs(capacity_factor=capacity_factor)
    assert rel_l2(y, emulated_fp8_experts(x, weights, ids, kept, w1, w2)) < 1e-4
    for name, g, rg in zip(("x", "weights", "w1", "w2"), grads, ref_grads):
        assert cos_sim(g, rg) > 0.99, name
        assert rel_l2(g, rg) < 0.1, name


def test_fp8_saves_quantized_activations():
    x, weights, ids, w1, w2, _ = make_inputs()
    y = experts(x.requires_grad_(), weights, ids, w1.requires_grad_(), w2.requires_grad_())
    saved = y.grad_fn.saved_tensors
    big = [t for t in saved if t.numel() >= T * H]  # x, H = x·W1ᵀ and the weights: all FP8
    assert len(big) == 4 and all(t.dtype == torch.float8_e4m3fn for t in big)


def test_dropped_tokens_give_zero():
    x, weights, ids, w1, w2, _ = make_inputs()
    ids = ids.clone()
    ids[:, :] = torch.tensor([0, 1])  # every token to experts 0 and 1: C = 48 of 96
    x.requires_grad_()
    y = experts(x, weights, ids, w1, w2, capacity_factor=1.0, drop_policy="position")
    y.sum().backward()
    assert (y[48:] == 0).all() and (x.grad[48:] == 0).all()
    assert (y[:48] != 0).any(dim=1).all()


def test_bf16_activations_fp32_master_weights():
    x, weights, ids, w1, w2, kept = make_inputs()
    xb = x.bfloat16().requires_grad_()
    w1.requires_grad_()
    w2.requires_grad_()
    weights.requires_grad_()
    y = experts(xb, weights, ids, w1, w2)
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and w1.grad.dtype == torch.float32 and weights.grad.dtype == torch.float32
    ref = reference_experts(x.double(), weights.double(), ids, kept, w1.double(), w2.double())
    assert rel_l2(y, ref) < 8e-2


def test_inputs_not_modified():
    x, weights, ids, w1, w2, _ = make_inputs()
    leaves = [t.requires_grad_() for t in (x, weights, w1, w2)]
    before = [t.detach().clone() for t in (*leaves, ids)]
    experts(x, weights, ids, w1, w2, capacity_factor=0.8).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(before, (*leaves, ids)))


def reference_module(m, x):
    """The layer in float64, plain autograd, same routing choices."""
    logits = x.double() @ m.router.weight.double().T
    r = route(logits.detach(), m.top_k, capacity_factor=m.capacity_factor)
    weights = torch.softmax(logits, -1).gather(-1, r.topk_ids)
    weights = weights / weights.sum(-1, keepdim=True)
    return reference_experts(x.double(), weights, r.topk_ids, r.kept, m.w1.double(), m.w2.double())


@pytest.mark.parametrize("recipe", ["fp8_block", None])
def test_module_forward_backward(recipe):
    torch.manual_seed(0)
    m = MoE(H, FFN, E, K, capacity_factor=1.25, recipe=recipe)
    ref_m = MoE(H, FFN, E, K, capacity_factor=1.25, recipe=None)
    ref_m.load_state_dict(m.state_dict())
    x = torch.randn(2, T // 2, H, requires_grad=True)
    x_ref = x.detach().reshape(-1, H).double().requires_grad_()
    y, routing = m(x, return_routing=True)
    assert y.shape == x.shape and routing.stats()["capacity"] == 60
    ref = reference_module(ref_m, x_ref)
    dy = torch.randn_like(ref)
    y.reshape(-1, H).backward(dy.float())
    ref.backward(dy)
    assert cos_sim(x.grad.reshape(-1, H), x_ref.grad) > (0.99 if recipe else 1 - 1e-9)  # router path included
    for name in ("router.weight", "w1", "w2"):
        g, rg = m.get_parameter(name).grad, ref_m.get_parameter(name).grad
        assert g is not None and g.dtype == torch.float32, name
        if recipe is None:
            assert rel_l2(g, rg) < 1e-5, name
        else:
            assert cos_sim(g, rg) > 0.99, name
    assert rel_l2(y.reshape(-1, H), ref) < (8e-2 if recipe else 1e-5)


def test_training_reduces_loss():
    torch.manual_seed(0)
    m = MoE(64, 64, 4, 2)
    teacher = MoE(64, 64, 4, 2, recipe=None)
    x = torch.randn(128, 64)
    with torch.no_grad():
        target = teacher(x) * 4
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    router0 = m.router.weight.detach().clone()
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = F.mse_loss(m(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    assert not torch.equal(m.router.weight, router0)


def test_empty_batch():
    m = MoE(32, 32, 4, 2)
    x = torch.zeros(0, 32, requires_grad=True)
    y = m(x)
    y.sum().backward()
    assert y.shape == (0, 32) and x.grad.shape == (0, 32)


def test_errors():
    with pytest.raises(ValueError, match="hidden_size: must be a multiple of 16"):
        MoE(100, 64, 4, 2)
    with pytest.raises(ValueError, match="ffn_size: must be a multiple of 16"):
        MoE(64, 40, 4, 2)
    MoE(100, 40, 4, 2, recipe=None)  # the unquantized baseline takes any size
    with pytest.raises(ValueError, match="top_k: 5 is more than num_experts=4"):
        MoE(64, 64, 4, 5)
    for bad in (0, -0.5):
        with pytest.raises(ValueError, match="capacity_factor"):
            MoE(64, 64, 4, 2, capacity_factor=bad)
    for kwargs, match in (({"activation": "relu"}, "activation"), ({"recipe": "fp8"}, "recipe"),
                          ({"score_func": "tanh"}, "score_func"), ({"drop_policy": "random"}, "drop_policy")):
        with pytest.raises(ValueError, match=match):
            MoE(64, 64, 4, 2, **kwargs)
    with pytest.raises(ValueError, match="num_experts"):
        MoE(64, 64, 0, 1)
    m = MoE(64, 64, 4, 2)
    with pytest.raises(ValueError, match=r"x: expected .* \[\.\.\., H=64\]"):
        m(torch.randn(8, 32))
    with pytest.raises(ValueError, match="x:"):
        m(torch.randn(8, 64, dtype=torch.float64))

    x, weights, ids, w1, w2, _ = make_inputs()
    with pytest.raises(ValueError, match="x:"):
        experts(x[None], weights, ids, w1, w2)
    with pytest.raises(ValueError, match="w1"):
        experts(x, weights, ids, w1[:, :-1], w2)
    with pytest.raises(ValueError, match="w1"):
        experts(x, weights, ids, w1[..., :64], w2)
    with pytest.raises(ValueError, match="w2"):
        experts(x, weights, ids, w1, w2[..., :32])
    with pytest.raises(ValueError, match="w2"):
        experts(x, weights, ids, w1, w2.int())
    with pytest.raises(ValueError, match="topk_ids"):
        experts(x, weights, ids[:-1], w1, w2)
    with pytest.raises(ValueError, match="topk_ids"):
        experts(x, weights, ids.float(), w1, w2)
    with pytest.raises(ValueError, match="topk_ids: expert ids must be"):
        experts(x, weights, ids + E, w1, w2)
    with pytest.raises(ValueError, match="capacity_factor"):
        experts(x, weights, ids, w1, w2, capacity_factor=0)
    with pytest.raises(ValueError, match="top_k"):
        experts(x, weights.repeat(1, 3), ids.repeat(1, 3), w1, w2)


def test_experts_without_id_check_gives_the_same_result():
    x, weights, ids, w1, w2, _ = make_inputs()
    checked = experts(x, weights, ids, w1, w2)
    assert torch.equal(experts(x, weights, ids, w1, w2, check_ids=False), checked)
    with pytest.raises(ValueError, match="topk_ids"):
        experts(x, weights, torch.full_like(ids, E), w1, w2)


def test_fp8_weights_given_as_quantized_tensors(device):
    """Pre-quantized (inference) weights: the same output as quantizing per call, the same dx and
    topk-weight gradients, and no weight gradients."""
    x, weights, ids, w1, w2, _ = (t.to(device) for t in make_inputs(seed=3))
    w1q, w2q = lowprec.quantize(w1, "fp8_block128x128"), lowprec.quantize(w2, "fp8_block128x128")
    dy = torch.randn(T, H, device=device, generator=torch.Generator(device=device).manual_seed(4))
    outs = []
    for a, b in ((w1, w2), (w1q, w2q)):
        xl, wl = x.clone().requires_grad_(), weights.clone().requires_grad_()
        y = experts(xl, wl, ids, a, b)
        y.backward(dy)
        outs.append((y, xl.grad, wl.grad))
    for got, want in zip(outs[1], outs[0]):
        assert torch.equal(got, want)
    with torch.no_grad():
        assert torch.equal(experts(x, weights, ids, w1q, w2q), outs[0][0])


def test_fp8_weights_errors():
    x, weights, ids, w1, w2, _ = make_inputs()
    w1q = lowprec.quantize(w1, "fp8_block128x128")
    with pytest.raises(ValueError, match="w2: with FP8 weights"):
        experts(x, weights, ids, w1q, w2)
    with pytest.raises(ValueError, match="w1: with FP8 weights"):
        experts(x, weights, ids, lowprec.quantize(w1, "fp8_block1x128"), lowprec.quantize(w2, "fp8_block128x128"))
    with pytest.raises(ValueError, match="recipe"):
        experts(x, weights, ids, w1q, lowprec.quantize(w2, "fp8_block128x128"), recipe=None)


def test_inference_module_matches_the_fp8_forward_and_roundtrips(device, tmp_path):
    """FP8InferenceMoE: the FP8 forward of the MoE it came from (same bits, same input gradient),
    about half the expert-weight bytes, and a safetensors round trip that gives the same outputs."""
    m = MoE(H, FFN, 16, K, device=device, dtype=torch.bfloat16)  # E = 16: a router convert() could swap
    infer = FP8InferenceMoE.from_moe(m)
    assert [n for n, _ in infer.named_parameters()] == ["router.weight"]
    expert_bytes = sum(getattr(m, n).nbytes for n in ("w1", "w2"))
    assert sum(b.nbytes for b in infer.buffers()) < 0.55 * expert_bytes
    x = torch.randn(3, T // 3, H, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        want, want_routing = m(x, return_routing=True)
        got, got_routing = infer(x, return_routing=True)
    assert torch.equal(got, want) and torch.equal(got_routing.topk_ids, want_routing.topk_ids)
    dy = torch.randn_like(x)
    grads = []
    for layer in (m, infer):
        xl = x.clone().requires_grad_()
        layer(xl).backward(dy)
        grads.append(xl.grad)
    assert torch.equal(grads[1], grads[0])

    path = tmp_path / "moe.safetensors"
    lowprec.save(infer.state_dict(), path)
    fresh = FP8InferenceMoE(H, FFN, 16, K, device=device, dtype=torch.bfloat16)
    fresh.load_state_dict(lowprec.load(path, device=device))
    with torch.no_grad():
        assert torch.equal(fresh(x), want)


def test_convert_keeps_the_router_and_makes_inference_experts():
    """convert() leaves an MoE's router alone (it is read as an FP32 weight: an FP8InferenceLinear
    there once gave raw FP8 codes as router weights) and, for inference, swaps in FP8InferenceMoE."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(H, H), MoE(H, FFN, 16, K))
    x = torch.randn(T, H)
    lowprec.convert(model, min_weight_numel=0)
    assert isinstance(model[0], lowprec.nn.FP8Linear) and type(model[1].router) is torch.nn.Linear
    with torch.no_grad():
        y_train = model(x)
    skipped = lowprec.convert(model, inference=True, filter_fn=lambda name, _: name != "1")
    assert type(skipped[1]) is MoE
    lowprec.convert(model, inference=True)
    assert isinstance(model[1], FP8InferenceMoE) and type(model[1].router) is torch.nn.Linear
    with torch.no_grad():
        assert torch.equal(model(x), y_train)
    assert isinstance(lowprec.convert(MoE(H, FFN, 16, K), inference=True), FP8InferenceMoE)
    bare = MoE(H, FFN, 16, K)
    assert lowprec.convert(bare) is bare


def test_inference_module_errors():
    with pytest.raises(TypeError, match="moe: expected a lowprec.moe.MoE"):
        FP8InferenceMoE.from_moe(torch.nn.Linear(H, H))
    with pytest.raises(ValueError, match="hidden_size: must be a multiple of 16"):
        FP8InferenceMoE(100, 64, 4, 2)
    with pytest.raises(ValueError, match="top_k: 5 is more than num_experts=4"):
        FP8InferenceMoE(64, 64, 4, 5)
    with pytest.raises(ValueError, match=r"x: expected a float32/bfloat16/float16 tensor \[\.\.\., H=64\]"):
        FP8InferenceMoE(64, 64, 4, 2)(torch.randn(8, 32))


def test_module_under_torch_compile_on_cpu():
    """On CPU the reference path is traced (with graph breaks at its data-dependent sizes) and
    gives the eager result (on CUDA the layer runs eagerly: tests/moe/test_layer_sm90.py)."""
    torch.manual_seed(0)
    m = MoE(H, FFN, E, K)
    x = torch.randn(T, H)
    compiled = torch.compile(m, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(x), m(x))


def test_experts_under_torch_compile_with_a_numpy_or_fraction_capacity_factor():
    """Dynamo makes a numpy factor a tensor and cannot trace a Fraction: without fullgraph the call
    graph-breaks and runs eagerly (the eager result); with fullgraph the error says what to pass."""
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(T, H), torch.randn(E, 2 * FFN, H) * 0.05, torch.randn(E, H, FFN) * 0.05
    weights, ids = torch.randn(T, E).softmax(-1).topk(K)
    for factor in (np.float32(0.75), Fraction(3, 4), 0.75):
        expect = experts(x, weights, ids, w1, w2, recipe=None, capacity_factor=factor)
        torch._dynamo.reset()
        got = torch.compile(experts, backend="aot_eager")(x, weights, ids, w1, w2, recipe=None,
                                                          capacity_factor=factor)
        assert torch.equal(got, expect)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"capacity_factor: expected a Python float, int or None under torch.compile "
                                        r".*: pass float\(capacity_factor\)"):
        torch.compile(experts, backend="aot_eager", fullgraph=True)(x, weights, ids, w1, w2, recipe=None,
                                                                    capacity_factor=np.float32(0.75))


@pytest.mark.parametrize("cast", [lambda m: m.half(), lambda m: m.bfloat16(), lambda m: m.to(torch.float16),
                                  lambda m: m.float()], ids=["half", "bfloat16", "to_dtype", "float"])
def test_inference_module_casts_keep_fp8_experts_and_fp32_scales(cast):
    """Module casts move the router (a float parameter) and leave the FP8 expert weights and
    their FP32 scales as they are (they once doubled in memory and flushed small scales to 0)."""
    torch.manual_seed(4)
    m = MoE(H, FFN, E, K, dtype=torch.bfloat16)
    with torch.no_grad():
        m.w2[0] *= 1e-9  # scales below FP16's smallest subnormal
    infer = FP8InferenceMoE.from_moe(m)
    before = {n: b.clone() for n, b in infer.named_buffers()}
    x = torch.randn(T, H, dtype=torch.bfloat16)
    ref = FP8InferenceMoE.from_moe(m)
    cast(ref.router)  # what the cast may change: the router
    assert cast(infer) is infer
    for name, b in infer.named_buffers():
        assert b.dtype == before[name].dtype and torch.equal(b.view(torch.uint8), before[name].view(torch.uint8))
    with torch.no_grad():
        assert torch.equal(infer(x), ref(x))


def test_inference_module_refuses_float_expert_weights():
    m = MoE(H, FFN, E, K)
    infer = FP8InferenceMoE.from_moe(m)
    with pytest.raises(RuntimeError, match="w1: expected torch.float8_e4m3fn"):
        infer.load_state_dict({**infer.state_dict(), "w1": m.w1.detach()})


@pytest.mark.parametrize("recipe", [None, "fp8_block"])
@pytest.mark.parametrize("activation", ["geglu", "swiglu"])
def test_experts_double_backward_is_an_error(recipe, activation):
    torch.manual_seed(0)
    t, h, f, e = 6, 16, 16, 2
    x = torch.randn(t, h, requires_grad=True)
    w = torch.rand(t, 1, requires_grad=True)
    ids = torch.randint(0, e, (t, 1))
    w1 = torch.randn(e, 2 * f, h, requires_grad=True)
    w2 = torch.randn(e, h, f, requires_grad=True)
    y = experts(x, w, ids, w1, w2, recipe=recipe, activation=activation)
    (gw2,) = torch.autograd.grad(y.pow(2).sum(), w2, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gw2.pow(2).sum().backward()


def test_experts_first_derivative_unchanged_with_create_graph():
    torch.manual_seed(0)
    x = torch.randn(6, 16, requires_grad=True)
    w = torch.rand(6, 1, requires_grad=True)
    ids = torch.randint(0, 2, (6, 1))
    w1 = torch.randn(2, 32, 16, requires_grad=True)
    w2 = torch.randn(2, 16, 16, requires_grad=True)
    y = experts(x, w, ids, w1, w2, recipe=None, activation="geglu")
    g1 = torch.autograd.grad(y.sum(), (x, w, w1, w2), retain_graph=True)
    g2 = torch.autograd.grad(y.sum(), (x, w, w1, w2), create_graph=True)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


def test_fp8_inference_moe_scales_are_fp32_whatever_the_default_dtype():
    """The scale buffers are FP32 (quantize's) under torch.set_default_dtype(torch.float64): a saved
    layer loads into a fresh one and runs (was: float64 scales, the load refused, the forward raising)."""
    torch.manual_seed(0)
    ref = FP8InferenceMoE.from_moe(MoE(128, 128, 4, 2))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        layer = FP8InferenceMoE(128, 128, 4, 2, dtype=torch.float32)
        assert layer.w1_scale.dtype == layer.w2_scale.dtype == torch.float32
        layer.load_state_dict(ref.state_dict())
        x = torch.randn(8, 128, dtype=torch.float32)
        assert torch.equal(layer(x), ref(x))
    finally:
        torch.set_default_dtype(default)


def test_second_derivative_through_the_experts_is_an_error_not_a_silent_zero():
    """A gradient penalty on x: dx depends on w1 and w2, which the experts' backward (quantized
    GEMMs, no graph) cannot differentiate again: an error, also from a constant incoming gradient."""
    torch.manual_seed(0)
    m = MoE(H, FFN, E, K)
    x = torch.randn(16, H, requires_grad=True)
    (dx,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dx.square().sum().backward()


def test_second_derivative_through_a_non_leaf_input_is_an_error_not_a_dropped_term():
    """A weight-gradient penalty from a constant incoming gradient, differentiated w.r.t. what feeds the
    layer: dW1 depends on x, reached only through the non-leaf inputs the error node did not hang on."""
    torch.manual_seed(0)
    m = MoE(H, FFN, E, K)
    x0 = torch.randn(16, H, requires_grad=True)
    y = m(x0 * 2)
    (dw1,) = torch.autograd.grad(y.sum(), m.w1, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        torch.autograd.grad(y.sum() + dw1.square().sum(), x0)


@pytest.mark.parametrize("recipe", ["fp8_block", None])
@pytest.mark.parametrize("frozen, x_grad", [(("w1",), True), (("w2",), True), (("w1", "w2"), True),
                                            (("router.weight",), False), (("router.weight", "w1"), False)])
def test_frozen_parameters_and_inputs_without_gradient(recipe, frozen, x_grad):
    """Frozen expert weights or router, or x without gradient: the rest get the gradients they get
    when everything trains, bit for bit (the float64 reference comparison: test_module_forward_backward);
    the frozen parameters get none."""
    torch.manual_seed(0)
    trained = MoE(H, FFN, E, K, recipe=recipe)
    partly = MoE(H, FFN, E, K, recipe=recipe)
    partly.load_state_dict(trained.state_dict())
    for name in frozen:
        partly.get_parameter(name).requires_grad_(False)
    x = torch.randn(T, H)
    dy = torch.randn(T, H)
    x_all, x_part = x.clone().requires_grad_(), x.clone().requires_grad_(x_grad)
    trained(x_all).backward(dy)
    partly(x_part).backward(dy)
    for name, p in partly.named_parameters():
        if name in frozen:
            assert p.grad is None, name
        else:
            assert torch.equal(p.grad, trained.get_parameter(name).grad), name
    assert torch.equal(x_part.grad, x_all.grad) if x_grad else x_part.grad is None


def test_top_1_with_renormalize_warns_that_the_router_cannot_train():
    """Renormalizing one weight makes it 1: the router's gradient is zero (softmax and sigmoid alike)."""
    with pytest.warns(UserWarning, match="top_k=1 with renormalize=True"):
        layer = MoE(32, 32, 4, 1, recipe=None, score_func="sigmoid")
    x = torch.randn(6, 32)
    layer(x).sum().backward()
    assert layer.router.weight.grad.abs().max() < 1e-6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MoE(32, 32, 4, 1, recipe=None, renormalize=False)
        MoE(32, 32, 4, 2, recipe=None)
