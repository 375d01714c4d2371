"""The fused FP8 SwiGLU MLP (lowprec.nn.swiglu): the same GEMMs as three FP8Linear layers, the
activation fused with its quantizations; convert's recognition of SwiGLU MLPs."""

import itertools
import logging
import warnings

import pytest
import torch
from torch import nn

import lowprec
from lowprec import metrics
from lowprec.nn import FP8InferenceLinear, FP8Linear, FP8SwiGLUMLP, SwiGLUMLP, fp8_swiglu_mlp, swiglu
from lowprec.quant.ops import swiglu_values


def _pair(hidden=256, ffn=384, dtype=torch.float32, seed=0, recipe="fp8_block"):
    """A fused MLP and three FP8Linear layers on copies of the same weights."""
    torch.manual_seed(seed)
    plain = SwiGLUMLP(hidden, ffn, dtype=dtype)
    unfused = lowprec.convert(SwiGLUMLP(hidden, ffn, dtype=dtype), recipe, min_weight_numel=0, fuse_mlp=False)
    unfused.load_state_dict(plain.state_dict())
    return lowprec.convert(plain, recipe, min_weight_numel=0), unfused


@pytest.mark.parametrize("recipe", ["fp8_block", "fp8_block_wgrad16", "fp8_block_wgrad2d"])
def test_fp32_equals_three_fp8_linear_layers_bit_for_bit(recipe):
    """With FP32 activations the unfused layers also compute silu(g) · u in FP32: every output and
    gradient is the same, so the fusion changes only where the work happens."""
    fused, unfused = _pair(recipe=recipe)
    assert isinstance(fused, FP8SwiGLUMLP) and isinstance(unfused.gate_proj, FP8Linear)
    assert fused.recipe == recipe and unfused.gate_proj.recipe.name == recipe
    x = torch.randn(2, 150, 256, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = fused(x), unfused(x2)
    assert torch.equal(y, y2)
    dy = torch.randn_like(y)
    y.backward(dy)
    y2.backward(dy)
    assert torch.equal(x.grad, x2.grad)
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(getattr(fused, name).weight.grad, getattr(unfused, name).weight.grad)


def test_bf16_close_to_exact_and_to_unfused():
    fused, unfused = _pair(dtype=torch.bfloat16)
    x = torch.randn(300, 256, dtype=torch.bfloat16)
    w = [getattr(fused, n).weight.double() for n in ("gate_proj", "up_proj", "down_proj")]
    xd = x.double()
    exact = (torch.nn.functional.silu(xd @ w[0].T) * (xd @ w[1].T)) @ w[2].T
    y = fused(x)
    assert y.dtype == torch.bfloat16 and y.shape == (300, 256)
    assert metrics.rel_l2(y, exact) < 0.08
    # the unfused layers round silu(g) and the product to bf16 first: close, not equal
    assert metrics.rel_l2(y, unfused(x)) < 0.03


@pytest.mark.parametrize("recipe_2", ["fp8_block_wgrad16", "fp8_block_wgrad2d"])
def test_wgrad_recipes_change_only_the_weight_gradients(recipe_2):
    """``fp8_block_wgrad16`` / ``_wgrad2d`` quantize only the weight gradients' activations
    differently: the output and the input gradient equal ``fp8_block``'s bit for bit, the weight
    gradients do not (16x128 / 128x128 scales over features x tokens instead of 1x128 over tokens)
    but stay close."""
    results = []
    for recipe in ("fp8_block", recipe_2):
        fused, _ = _pair(recipe=recipe)
        g = torch.Generator().manual_seed(3)
        # rows of very different magnitudes: a 128x128 scale then differs from the rows' own
        x = (torch.randn(300, 256, generator=g) * torch.exp(2 * torch.randn(300, 1, generator=g))).requires_grad_()
        y = fused(x)
        y.backward(torch.randn(y.shape, generator=g))
        results.append([y, x.grad] + [p.grad for p in fused.parameters()])
    (y, dx, *dws), (y2, dx2, *dws2) = results
    assert torch.equal(y, y2) and torch.equal(dx, dx2)
    for dw, dw2 in zip(dws, dws2):
        assert not torch.equal(dw, dw2) and metrics.cos_sim(dw, dw2) > 0.99


@pytest.mark.parametrize("recipe", ["fp8_block", "fp8_block_wgrad16", "fp8_block_wgrad2d"])
def test_gradients_close_to_exact(recipe):
    fused, _ = _pair(recipe=recipe)
    x = torch.randn(200, 256, dtype=torch.float64).float().requires_grad_()
    ws = [getattr(fused, n).weight for n in ("gate_proj", "up_proj", "down_proj")]
    exact_leaves = [t.detach().double().requires_grad_() for t in (x, *ws)]
    xe, ge, ue, de = exact_leaves
    ((torch.nn.functional.silu(xe @ ge.T) * (xe @ ue.T)) @ de.T).sum().backward()
    fused(x).sum().backward()
    for got, ref in zip((x, *ws), exact_leaves):
        assert metrics.cos_sim(got.grad, ref.grad) > 0.99


def test_swiglu_values_are_silu_times_up_and_its_gradients():
    g, u, da = (torch.randn(64, 128, dtype=torch.bfloat16) for _ in range(3))
    gf, uf = g.float().requires_grad_(), u.float().requires_grad_()
    a = torch.nn.functional.silu(gf) * uf
    a.backward(da.float())
    assert torch.equal(swiglu_values("swiglu", (g, u)), a.detach())
    torch.testing.assert_close(swiglu_values("swiglu_dgate", (g, u, da)), gf.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(swiglu_values("swiglu_dup", (g, da)), uf.grad, rtol=1e-6, atol=1e-6)


def test_autocast_follows_nn_linear():
    """FP32 master weights under autocast: bf16 output, FP32 gradients, as nn.Linear."""
    fused, _ = _pair()
    x = torch.randn(64, 256, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        y = fused(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and fused.gate_proj.weight.grad.dtype == torch.float32


def test_frozen_weights_and_no_grad():
    fused, _ = _pair()
    for p in fused.parameters():
        p.requires_grad_(False)
    x = torch.randn(32, 256, requires_grad=True)
    fused(x).sum().backward()
    assert x.grad is not None and fused.gate_proj.weight.grad is None
    with torch.no_grad():
        assert fused(x).shape == (32, 256)


@pytest.mark.parametrize("needs", [m for m in itertools.product([False, True], repeat=4) if any(m)])
def test_each_gradient_alone_equals_the_full_backward(needs, device):
    """The backward computes only what is asked for (frozen weights, inputs without gradient):
    each gradient it gives equals the one of the run that asks for all four."""
    torch.manual_seed(5)
    fused = lowprec.convert(SwiGLUMLP(256, 384, device=device), min_weight_numel=0)
    x, dy = torch.randn(40, 256, device=device), torch.randn(40, 256, device=device)
    full = x.clone().requires_grad_()
    fused(full).backward(dy)
    want = [full.grad] + [p.grad.clone() for p in fused.parameters()]
    fused.zero_grad()
    xl = x.clone().requires_grad_(needs[0])
    for p, need in zip(fused.parameters(), needs[1:]):
        p.requires_grad_(need)
    fused(xl).backward(dy)
    for need, got, ref in zip(needs, [xl.grad] + [p.grad for p in fused.parameters()], want):
        assert (got is not None) == need
        if need:
            assert torch.equal(got, ref)


@pytest.mark.parametrize("needs", [m for m in itertools.product([False, True], repeat=4) if any(m)])
def test_x_is_quantized_along_tokens_only_for_the_gate_and_up_gradients(needs, monkeypatch):
    """The forward's x along tokens feeds only W_gate's and W_up's gradients: W_down's (or x's)
    alone quantizes x once, along features, and saves no transposed x."""
    calls = []
    real_dual, real_quantize = swiglu.quantize_dual, swiglu.quantize
    monkeypatch.setattr(swiglu, "quantize_dual", lambda x, *a, **k: calls.append("dual") or real_dual(x, *a, **k))
    monkeypatch.setattr(swiglu, "quantize", lambda x, *a, **k: calls.append("one") or real_quantize(x, *a, **k))
    torch.manual_seed(5)
    leaves = [torch.randn(40, 128), torch.randn(256, 128), torch.randn(256, 128), torch.randn(128, 256)]
    leaves = [t.requires_grad_(need) for t, need in zip(leaves, needs)]
    y = fp8_swiglu_mlp(*leaves)
    assert calls == (["dual"] if needs[1] or needs[2] else ["one"])
    y.sum().backward()
    assert [t.grad is not None for t in leaves] == list(needs)


@pytest.mark.parametrize("need_down", [False, True])
def test_the_activation_along_tokens_is_kept_only_for_w_downs_gradient(need_down):
    """A along tokens ([F, T padded] FP8 and its scales) feeds only W_down's gradient: with W_down
    frozen it was kept until the backward all the same."""
    torch.manual_seed(5)
    leaves = [torch.randn(40, 128), torch.randn(256, 128), torch.randn(256, 128), torch.randn(128, 256)]
    for t, need in zip(leaves, (True, True, True, need_down)):
        t.requires_grad_(need)
    y = fp8_swiglu_mlp(*leaves)
    saved = [tuple(t.shape) for t in y.grad_fn.saved_tensors]
    assert ((256, 48) in saved) == need_down  # F = 256 rows, 40 tokens padded to 48
    y.sum().backward()
    assert (leaves[3].grad is not None) == need_down


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "nothing_requires_grad"])
def test_evaluation_makes_no_copies_for_a_backward_and_gives_the_training_forwards_bits(mode, monkeypatch):
    """An evaluation (grad mode off, or no input requiring grad) quantized x along tokens and the
    weights transposed, as a training forward does, for a backward that cannot come."""
    torch.manual_seed(5)
    leaves = [torch.randn(40, 128), torch.randn(256, 128), torch.randn(256, 128), torch.randn(128, 256)]
    want = fp8_swiglu_mlp(*[t.clone().requires_grad_() for t in leaves]).detach()
    monkeypatch.setattr(swiglu, "quantize_dual", lambda *a, **k: pytest.fail("x quantized along tokens"))
    real_weight = swiglu.quantize_weight

    def weight_once(w, recipe, with_transpose):
        assert not with_transpose, "a transposed weight quantized"
        return real_weight(w, recipe, with_transpose)

    monkeypatch.setattr(swiglu, "quantize_weight", weight_once)
    if mode == "nothing_requires_grad":
        got = fp8_swiglu_mlp(*leaves)
    else:
        with getattr(torch, mode)():
            got = fp8_swiglu_mlp(*[t.requires_grad_() for t in leaves])
    assert torch.equal(got, want)


def test_inputs_not_mutated():
    fused, _ = _pair()
    x = torch.randn(40, 256)
    before = x.clone(), [p.detach().clone() for p in fused.parameters()]
    fused(x).sum().backward()
    assert torch.equal(x, before[0])
    assert all(torch.equal(p, q) for p, q in zip(fused.parameters(), before[1]))


def test_errors_name_the_argument():
    w = torch.randn(384, 256)
    with pytest.raises(ValueError, match="w_down"):
        fp8_swiglu_mlp(torch.randn(4, 256), w, w, torch.randn(384, 256))
    with pytest.raises(ValueError, match="w_gate, w_up"):
        fp8_swiglu_mlp(torch.randn(4, 256), w, torch.randn(385, 256), torch.randn(256, 384))
    with pytest.raises(ValueError, match="hidden size"):
        fp8_swiglu_mlp(torch.randn(4, 200), torch.randn(384, 200), torch.randn(384, 200), torch.randn(200, 384))
    with pytest.raises(ValueError, match="x:"):
        fp8_swiglu_mlp(torch.randint(0, 3, (4, 256)), w, w, torch.randn(256, 384))
    with pytest.raises(ValueError, match="recipe: the fused SwiGLU MLP computes"):
        fp8_swiglu_mlp(torch.randn(4, 256), w, w, torch.randn(256, 384), recipe="fp8_rowwise")


class LlamaMLP(nn.Module):
    """transformers' LlamaMLP, as its forward reads."""

    def __init__(self, hidden, ffn, bias=False, act=None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=bias)
        self.up_proj = nn.Linear(hidden, ffn, bias=bias)
        self.down_proj = nn.Linear(ffn, hidden, bias=bias)
        self.act_fn = act or nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.norm = nn.LayerNorm(256)
        self.mlp = mlp

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def test_convert_recognises_llama_mlps_and_keeps_parameters(caplog):
    model = nn.Sequential(Block(LlamaMLP(256, 384)), Block(SwiGLUMLP(256, 384)))
    params = {n: p for n, p in model.named_parameters()}
    x = torch.randn(8, 256)
    with caplog.at_level(logging.INFO, logger="lowprec"):
        lowprec.convert(model, min_weight_numel=0)
    assert "2 fused FP8 SwiGLU MLPs" in caplog.text
    assert all(isinstance(b.mlp, FP8SwiGLUMLP) for b in model)
    assert {n: p for n, p in model.named_parameters()} == params  # same names, same tensors
    assert set(model.state_dict()) == set(params)
    assert model(x).shape == (8, 256)


class SiLUActivation(nn.Module):
    """transformers' own SiLU module (not an nn.SiLU)."""

    def forward(self, x):
        return nn.functional.silu(x)


def test_convert_recognises_silu_by_what_it_computes():
    block = lowprec.convert(Block(LlamaMLP(256, 384, act=SiLUActivation())), min_weight_numel=0)
    assert isinstance(block.mlp, FP8SwiGLUMLP)


def test_convert_leaves_other_mlps_to_the_linear_pass():
    biased = Block(LlamaMLP(256, 384, bias=True))
    gelu = Block(LlamaMLP(256, 384, act=nn.GELU()))
    scaled = Block(LlamaMLP(256, 384, act=nn.Sequential(nn.SiLU(), nn.Linear(384, 384))))
    for block in (biased, gelu, scaled):
        lowprec.convert(block, min_weight_numel=0)
        assert type(block.mlp) is LlamaMLP and isinstance(block.mlp.gate_proj, FP8Linear)


def test_convert_options_turn_fusion_off():
    # below the size threshold: nothing converted
    block = lowprec.convert(Block(SwiGLUMLP(256, 384)))
    assert type(block.mlp) is SwiGLUMLP and type(block.mlp.gate_proj) is nn.Linear
    # a filter rejecting one of the three layers: per-layer conversion of the accepted ones
    block = lowprec.convert(Block(SwiGLUMLP(256, 384)), min_weight_numel=0,
                            filter_fn=lambda name, m: not name.endswith("down_proj"))
    assert type(block.mlp) is SwiGLUMLP and isinstance(block.mlp.gate_proj, FP8Linear)
    assert type(block.mlp.down_proj) is nn.Linear
    # fp8_block_wgrad2d: a fused MLP takes it, as FP8Linear layers take a new recipe
    block = lowprec.convert(Block(SwiGLUMLP(256, 384)), min_weight_numel=0)
    lowprec.convert(block, "fp8_block_wgrad2d", min_weight_numel=0)
    assert isinstance(block.mlp, FP8SwiGLUMLP) and block.mlp.recipe == "fp8_block_wgrad2d"
    # another recipe or inference: a fused MLP is unfused, its layers converted one by one
    lowprec.convert(block, "fp8_rowwise", min_weight_numel=0)
    assert type(block.mlp) is SwiGLUMLP and block.mlp.gate_proj.recipe.name == "fp8_rowwise"
    block = lowprec.convert(Block(SwiGLUMLP(256, 384)), min_weight_numel=0)
    lowprec.convert(block, inference=True)
    assert type(block.mlp) is SwiGLUMLP and isinstance(block.mlp.up_proj, FP8InferenceLinear)
    # a bare MLP
    assert isinstance(lowprec.convert(SwiGLUMLP(256, 384)), FP8SwiGLUMLP)
    assert type(lowprec.convert(SwiGLUMLP(256, 384), fuse_mlp=False)) is SwiGLUMLP


@pytest.mark.parametrize("recipe", ["fp8_block", "fp8_block_wgrad16", "fp8_block_wgrad2d"])
def test_compile_fullgraph_forward_and_backward(recipe):
    fused, _ = _pair(recipe=recipe)
    x = torch.randn(33, 256, requires_grad=True)
    compiled = torch.compile(lambda t: fused(t).square().sum(), fullgraph=True, backend="aot_eager")
    compiled(x).backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in fused.parameters()]
    x.grad = None
    fused.zero_grad()
    fused(x).square().sum().backward()
    for got, want in zip(grads, [x.grad] + [p.grad for p in fused.parameters()]):
        torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8_block", "fp8_block_wgrad16", "fp8_block_wgrad2d"])
def test_gpu_kernels_match_the_reference_and_compiled_matches_eager(recipe, monkeypatch):
    """On the GPU every step runs its kernel (LOWPREC_BACKEND=kernel: a failure raises): close to
    the reference backend (the GEMM kernels and torch's matmul round differently), and inductor's
    compiled step equals the eager one bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(7)
    fused = lowprec.convert(SwiGLUMLP(512, 1408, device="cuda", dtype=torch.bfloat16), recipe, min_weight_numel=0)
    x = torch.randn(2, 300, 512, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)

    def run(fn):
        xl = x.clone().requires_grad_()
        y = fn(xl)
        y.backward(dy)
        out = [y.detach(), xl.grad] + [p.grad.clone() for p in fused.parameters()]
        fused.zero_grad()
        return out

    monkeypatch.setenv("LOWPREC_BACKEND", "reference")
    ref = run(fused)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    eager = run(fused)
    compiled = run(torch.compile(fused))
    for got, want, exact in zip(eager, ref, compiled):
        assert metrics.rel_l2(got, want) < 0.02
        assert torch.equal(exact, got)


@pytest.mark.gpu
def test_training_step_replays_from_cuda_graphs(monkeypatch):
    """torch.compile(fullgraph=True, mode="reduce-overhead"): forward and backward of the fused
    MLP replay from CUDA graphs (nothing reads back from the GPU), bit for bit the eager step for
    every new batch."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch._dynamo.utils import counters

    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    torch.manual_seed(8)
    counters.clear()
    fused = lowprec.convert(SwiGLUMLP(256, 512, device="cuda", dtype=torch.bfloat16), min_weight_numel=0)
    compiled = torch.compile(fused, fullgraph=True, mode="reduce-overhead")
    for step in range(4):
        x = torch.randn(384, 256, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        results = []
        for run, graphed in ((fused, False), (compiled, True)):
            if graphed:
                torch.compiler.cudagraph_mark_step_begin()
            xl = x.clone().requires_grad_()
            y = run(xl)
            y.backward(dy)
            results.append([y.detach().clone(), xl.grad] + [p.grad.clone() for p in fused.parameters()])
            fused.zero_grad(set_to_none=True)
        for got, want in zip(*results):
            assert torch.equal(got, want), step
    assert not counters["inductor"]["cudagraph_skips"]


def test_converting_a_fused_mlp_again_takes_the_new_recipe():
    """convert on a bare FP8SwiGLUMLP gives it the new recipe, as it does to one inside a model."""
    mlp = convert_fp8(SwiGLUMLP(64, 128), "fp8_block")
    assert isinstance(mlp, FP8SwiGLUMLP) and mlp.recipe == "fp8_block"
    assert convert_fp8(mlp, "fp8_block_wgrad2d").recipe == "fp8_block_wgrad2d"
    model = nn.Sequential(SwiGLUMLP(64, 128))
    convert_fp8(convert_fp8(model, "fp8_block"), "fp8_block_wgrad2d")
    assert model[0].recipe == "fp8_block_wgrad2d"


def convert_fp8(model, recipe):
    return lowprec.convert(model, recipe, min_weight_numel=0)


def test_the_fused_mlp_refuses_layers_with_biases():
    """It computes no biases: taking biased layers would drop them silently."""
    gate, up, down = nn.Linear(256, 512), nn.Linear(256, 512), nn.Linear(512, 256)
    with pytest.raises(ValueError, match="bias"):
        FP8SwiGLUMLP(gate, up, down, "fp8_block")


def test_bad_x_is_named():
    mlp = FP8SwiGLUMLP.from_mlp(SwiGLUMLP(256, 512), "fp8_block")
    with pytest.raises(ValueError, match=r"^x: last dim 272"):
        mlp(torch.randn(4, 272))
    with pytest.raises(ValueError, match="0-d"):
        mlp(torch.tensor(1.0))


def test_an_in_place_silu_is_silu_and_the_check_keeps_its_probe():
    from lowprec.nn.swiglu import _SILU_PROBE, swiglu_mlp_unsupported

    probe = _SILU_PROBE.clone()
    mlp = SwiGLUMLP(256, 512)
    mlp.act_fn = nn.SiLU(inplace=True)
    assert swiglu_mlp_unsupported(mlp) is None
    assert torch.equal(_SILU_PROBE, probe)


def test_convert_again_leaves_a_fused_mlp_the_filter_rejects_as_it_is():
    model = nn.Sequential(nn.Linear(128, 128), SwiGLUMLP(128, 256), SwiGLUMLP(128, 256))
    lowprec.convert(model, "fp8_block", min_weight_numel=0)
    assert isinstance(model[1], FP8SwiGLUMLP) and isinstance(model[2], FP8SwiGLUMLP)
    lowprec.convert(model, "fp8_block_wgrad2d", min_weight_numel=0,
                    filter_fn=lambda name, m: not name.startswith(("0", "1")))
    assert model[0].recipe.name == "fp8_block"  # a rejected FP8Linear keeps its recipe
    assert model[1].recipe == "fp8_block"  # so does a rejected fused MLP
    assert model[2].recipe == "fp8_block_wgrad2d"  # an accepted one takes the new recipe


@pytest.mark.parametrize("inference", [False, True])
def test_unfusing_convert_leaves_a_fused_mlp_the_filter_rejects_as_it_is(inference):
    # was: unfused anyway, its rejected layers left as nn.Linear (the FP8 MLP silently in high precision)
    recipe, layer = ("fp8_block", FP8InferenceLinear) if inference else ("fp8_rowwise", FP8Linear)
    model = nn.Sequential(SwiGLUMLP(128, 256), SwiGLUMLP(128, 256))
    lowprec.convert(model, "fp8_block", min_weight_numel=0)
    lowprec.convert(model, recipe, inference=inference, min_weight_numel=0,
                    filter_fn=lambda name, m: not name.startswith("0"))
    assert isinstance(model[0], FP8SwiGLUMLP) and model[0].recipe == "fp8_block"
    assert type(model[1]) is SwiGLUMLP and isinstance(model[1].gate_proj, layer)  # accepted: unfused, converted
    bare = FP8SwiGLUMLP.from_mlp(SwiGLUMLP(128, 256))
    assert lowprec.convert(bare, recipe, inference=inference, filter_fn=lambda name, m: False) is bare


@pytest.mark.parametrize("i", range(3))
def test_a_second_derivative_is_an_error_not_a_silent_zero(i):
    """The quantized backwards build no graph: a gradient penalty must fail, not drop its term."""
    torch.manual_seed(0)
    w = torch.randn(64, 128, requires_grad=True)
    layer = [lambda x: lowprec.nn.fp8_linear(x, w), FP8InferenceLinear.from_linear(nn.Linear(128, 64)),
             FP8SwiGLUMLP.from_mlp(SwiGLUMLP(128, 256))][i]
    x = torch.randn(8, 128, requires_grad=True)
    y = layer(x)
    (dx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (y.sum() + dx.square().sum()).backward()


@pytest.mark.parametrize("filter_fn", [None, lambda name, mod: not name.startswith("1.")])
def test_shared_mlp_is_fused_once_and_stays_shared(filter_fn):
    mlp = SwiGLUMLP(128, 256)
    model = torch.nn.ModuleList([mlp, mlp])
    lowprec.convert(model, min_weight_numel=0, filter_fn=filter_fn)  # by its first name, "0"
    assert isinstance(model[0], FP8SwiGLUMLP)
    assert model[1] is model[0]
    # unfused again (another recipe): still one module
    lowprec.convert(model, "fp8_rowwise", min_weight_numel=0)
    assert type(model[0]) is SwiGLUMLP and model[1] is model[0]


def test_fusion_does_not_depend_on_the_default_dtype():
    """The constructor's probe x is FP32 whatever the default dtype: an FP32 MLP converted under
    torch.set_default_dtype(torch.float64) gives the fused layer (was: an error naming an x the
    caller never passed)."""
    mlp = SwiGLUMLP(128, 256, dtype=torch.float32)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = lowprec.convert(torch.nn.Sequential(mlp), min_weight_numel=0)
    finally:
        torch.set_default_dtype(default)
    assert isinstance(model[0], FP8SwiGLUMLP)
    x = torch.randn(4, 128)
    assert model(x).dtype == torch.float32


def _weight_norm(linear):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for the parametrization, still used
        return torch.nn.utils.weight_norm(linear)


def test_training_convert_does_not_fuse_an_mlp_with_a_weight_normed_layer():
    mlp = SwiGLUMLP(128, 256)
    _weight_norm(mlp.gate_proj)
    model = lowprec.convert(nn.Sequential(mlp), "fp8_block", min_weight_numel=0)
    assert type(model[0]) is SwiGLUMLP and type(model[0].gate_proj) is nn.Linear
    assert isinstance(model[0].up_proj, lowprec.nn.FP8Linear)
    x = torch.randn(4, 128)
    for _ in range(2):
        model(x).sum().backward()
    assert model[0].gate_proj.weight_v.grad is not None


def test_convert_fuses_no_mlp_with_hooked_layers_and_carries_an_mlps_own_hooks():
    seen = []
    hooked_layers, hooked_mlp = SwiGLUMLP(128, 256), SwiGLUMLP(128, 256)
    hooked_layers.gate_proj.register_forward_hook(lambda m, args, y: seen.append(type(m).__name__))
    hooked_mlp.register_forward_hook(lambda m, args, y: seen.append(type(m).__name__))
    model = lowprec.convert(nn.Sequential(hooked_layers, hooked_mlp), "fp8_block", min_weight_numel=0)
    assert type(model[0]) is SwiGLUMLP and isinstance(model[0].gate_proj, FP8Linear)
    assert isinstance(model[1], FP8SwiGLUMLP)
    model(torch.randn(4, 128))
    assert seen == ["FP8Linear", "FP8SwiGLUMLP"]


def test_convert_fuses_no_mlp_whose_act_fn_has_hooks():
    """The fused MLP computes SiLU itself: a hook on act_fn (activation statistics) would never fire
    again, and convert's SiLU probe called it on a 41-value probe tensor."""
    seen = []
    mlp = SwiGLUMLP(128, 256)
    mlp.act_fn.register_forward_hook(lambda m, args, y: seen.append(tuple(y.shape)))
    model = lowprec.convert(nn.Sequential(mlp), "fp8_block", min_weight_numel=0)
    assert seen == []
    assert type(model[0]) is SwiGLUMLP and isinstance(model[0].gate_proj, FP8Linear)
    model(torch.randn(4, 128))
    assert seen == [(4, 256)]


def test_forward_mode_ad_is_an_error_not_a_silent_zero_tangent():
    # without requires_grad the evaluation path runs: its quantize and GEMM ops dropped the tangent
    w_gate, w_up, w_down = torch.randn(256, 128), torch.randn(256, 128), torch.randn(128, 256)
    x = torch.randn(8, 128)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda x: fp8_swiglu_mlp(x, w_gate, w_up, w_down), (x,), (torch.ones_like(x),))
