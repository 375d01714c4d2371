"""The FP8 MoE layer on Hopper with every GEMM on a kernel (``LOWPREC_BACKEND=kernel``: a kernel
failure fails the test instead of falling back): forward and gradients vs a float64 loop over
experts."""

import pytest
import torch

from lowprec.metrics import cos_sim, rel_l2
from lowprec.moe import experts

from .test_layer import T, make_inputs, reference_experts

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                               reason="needs an sm_90 GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("capacity_factor", [None, 0.6])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_fp8_layer_on_kernels(capacity_factor, weight_dtype, monkeypatch):
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    x, weights, ids, w1, w2, kept = make_inputs(capacity_factor=capacity_factor)
    w1, w2 = w1.to(weight_dtype).float(), w2.to(weight_dtype).float()  # the reference sees the same values
    dy = torch.randn(T, x.shape[1], generator=torch.Generator().manual_seed(100))
    leaves = [t.cuda().requires_grad_() for t in (x, weights, w1.to(weight_dtype), w2.to(weight_dtype))]
    y = experts(leaves[0], leaves[1], ids.cuda(), leaves[2], leaves[3], recipe="fp8_block",
                capacity_factor=capacity_factor)
    y.backward(dy.cuda())
    ref_leaves = [t.double().requires_grad_() for t in (x, weights, w1, w2)]
    ref = reference_experts(ref_leaves[0], ref_leaves[1], ids, kept, ref_leaves[2], ref_leaves[3])
    ref.backward(dy.double())
    assert rel_l2(y.cpu(), ref) < 8e-2  # two chained FP8 GEMMs, as on the CPU
    assert leaves[2].grad.dtype == leaves[3].grad.dtype == weight_dtype
    for name, g, rg in zip(("x", "weights", "w1", "w2"), [t.grad.cpu().float() for t in leaves],
                           [t.grad for t in ref_leaves]):
        assert cos_sim(g, rg) > 0.99, name
        assert rel_l2(g, rg) < 0.1, name


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows,ffn", [(300, 384), (1, 128), (100, 80), (64, 1040)])
def test_swiglu_backward_kernel_matches_torch_autograd(rows, ffn, monkeypatch):
    """The fused SwiGLU backward against the torch autograd steps it replaces, on the GPU: dh,
    its 1x128 quantization and act(h)·w bit for bit; ∂y/∂w, a sum in another order, within the
    rounding bound of the sum."""
    from lowprec import quantize
    from lowprec.moe.core import _activation_backward

    g = torch.Generator(device="cuda").manual_seed(rows + ffn)
    h = torch.randn(rows, 2 * ffn, device="cuda", generator=g) * 3
    h[0, :5] *= 30  # outliers: saturating exp(-g), large scales
    hq = quantize(h.to(torch.bfloat16), "fp8_block1x128")
    da = torch.randn(rows, ffn, device="cuda", generator=g)
    row_w = torch.rand(rows, device="cuda", generator=g)
    row_w[::7] = 0  # dropped / padding rows
    before = (hq.data.clone(), hq.scale.clone(), da.clone(), row_w.clone())
    monkeypatch.setenv("LOWPREC_BACKEND", "reference")
    ref = _activation_backward("swiglu", hq, da, row_w, True)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0x7F)  # poison the allocator
    out = _activation_backward("swiglu", hq, da, row_w, True)
    for name, o, r in (("dh", out[0], ref[0]), ("a", out[2], ref[2])):
        assert torch.equal(o, r), f"{name}: {(o != r).sum().item()} of {o.numel()} differ"
    assert torch.equal(out[1].data.view(torch.uint8), ref[1].data.view(torch.uint8))
    assert torch.equal(out[1].scale, ref[1].scale)
    # ∂y/∂w sums F products in another order: within the FP32 summation bound F·2⁻²⁴·Σ|terms|
    hd = hq.dequantize(torch.float32)
    terms = (da * torch.nn.functional.silu(hd[:, :ffn]) * hd[:, ffn:]).abs().sum(dim=1)
    assert ((out[3] - ref[3]).abs() <= ffn * 2.0**-24 * terms).all()
    for t, b in zip((hq.data, hq.scale, da, row_w), before):
        assert torch.equal(t, b)  # inputs untouched


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("inference", [False, True], ids=["MoE", "FP8InferenceMoE"])
def test_moe_forward_sync_free_and_graph_capturable(inference, monkeypatch):
    from lowprec.moe import FP8InferenceMoE, MoE

    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    torch.manual_seed(0)
    layer = MoE(256, 256, 8, 2).cuda()
    if inference:
        layer = FP8InferenceMoE.from_moe(layer)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    y0 = layer(x)  # compiles the kernels; with autograd on
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host copy or sync raises
    try:
        y1 = layer(x)
        with torch.no_grad():
            y2 = layer(x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        y3 = layer(x)
    x.copy_(torch.randn_like(x))  # new tokens, new routing, same buffers
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        y4 = layer(x)
    assert torch.equal(y1, y0) and torch.equal(y2, y0.detach())
    assert torch.equal(y3, y4)


@pytest.mark.gpu
@needs_gpu
def test_moe_training_step_compiles_whole_on_its_kernels(monkeypatch):
    """With gradients to come the layer traces as an autograd function over its training ops: the
    step compiles without a graph break (fullgraph) and runs the kernels (LOWPREC_BACKEND=kernel:
    a reference fallback would raise). Traced by aot_eager the outputs and gradients are eager's
    bit for bit; inductor compiles the router's softmax its own way (last-bit differences in the
    routing weights), so there they are close."""
    from lowprec.moe import FP8InferenceMoE, MoE

    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    torch.manual_seed(0)
    layer = MoE(256, 256, 8, 2, device="cuda", dtype=torch.bfloat16)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256, device="cuda", dtype=torch.bfloat16), layer)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    results = []
    for run in (model, torch.compile(model, fullgraph=True, backend="aot_eager"), torch.compile(model, fullgraph=True)):
        xl = x.clone().requires_grad_()
        y = run(xl)
        y.backward(dy)
        results.append([y.detach(), xl.grad] + [p.grad.clone() for p in model.parameters()])
        model.zero_grad()
    for got, want in zip(results[1], results[0]):
        assert torch.equal(got, want)
    for got, want in zip(results[2], results[0]):
        assert rel_l2(got.float(), want.float()) < 1e-2
    infer = FP8InferenceMoE.from_moe(layer)
    with torch.no_grad():
        assert torch.equal(torch.compile(infer)(x), infer(x))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("inference", [False, True], ids=["MoE", "FP8InferenceMoE"])
def test_inference_step_compiles_whole_into_cuda_graphs(inference, monkeypatch):
    """Without a gradient to come the layer is one custom op under torch.compile: the whole step
    compiles (fullgraph) and is captured into CUDA graphs (reduce-overhead), on the kernels
    (LOWPREC_BACKEND=kernel), with the eager result for every new batch of tokens."""
    from lowprec.moe import FP8InferenceMoE, MoE

    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    torch.manual_seed(0)
    layer = MoE(256, 256, 8, 2, capacity_factor=1.0, device="cuda", dtype=torch.bfloat16)
    if inference:
        layer = FP8InferenceMoE.from_moe(layer)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256, device="cuda", dtype=torch.bfloat16), layer)
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(compiled(x).clone(), model(x)), step


@pytest.mark.gpu
@needs_gpu
def test_training_step_compiles_into_cuda_graphs(monkeypatch):
    """The training step (router, experts, backward into every parameter) under
    torch.compile(fullgraph=True, mode="reduce-overhead"): forward and backward replay from CUDA
    graphs on the kernels (LOWPREC_BACKEND=kernel; nothing in the step reads back from the GPU),
    close to eager for every new batch (inductor rounds the router's softmax its own way)."""
    from torch._dynamo.utils import counters

    from lowprec.moe import MoE

    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    torch.manual_seed(0)
    counters.clear()
    layer = MoE(256, 256, 8, 2, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
    for step in range(4):
        x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        results = []
        for run, new_graph_step in ((layer, False), (compiled, True)):
            if new_graph_step:
                torch.compiler.cudagraph_mark_step_begin()
            xl = x.clone().requires_grad_()
            y = run(xl)
            y.backward(dy)
            results.append([y.detach().clone(), xl.grad] + [p.grad.clone() for p in layer.parameters()])
            layer.zero_grad(set_to_none=True)
        for got, want in zip(*results):
            assert rel_l2(got.float(), want.float()) < 1e-2, step
    assert not counters["inductor"]["cudagraph_skips"]  # inductor would run the step without graphs
