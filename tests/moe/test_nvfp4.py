"""NVFP4InferenceMoE: the MoE with NVFP4 expert weights (CPU: the reference path, the state dict,
convert; GPU: the grouped weight-only kernel against that reference)."""

import pytest
import torch

import lowprec
from lowprec.moe import MoE, NVFP4InferenceMoE
from lowprec.recipes import get_recipe

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                               reason="needs an sm_90 GPU")


def _moe(hidden=64, ffn=32, experts=4, top_k=2, capacity_factor=None, device="cpu", seed=0, **kw):
    torch.manual_seed(seed)
    return MoE(hidden, ffn, experts, top_k, capacity_factor=capacity_factor, recipe=None, device=device, **kw)


def _dequantized_moe(moe: MoE) -> MoE:
    """``moe`` with its expert weights replaced by their NVFP4 values: what the layer computes with."""
    ref = MoE(moe.hidden_size, moe.ffn_size, moe.num_experts, moe.top_k, capacity_factor=moe.capacity_factor,
              recipe=None, activation=moe.activation, drop_policy=moe.drop_policy, device=moe.w1.device)
    ref.load_state_dict(moe.state_dict())
    recipe = get_recipe("nvfp4")
    with torch.no_grad():
        for name in ("w1", "w2"):
            getattr(ref, name).copy_(torch.stack([lowprec.quantize(w, recipe).dequantize(torch.float32)
                                                  for w in getattr(moe, name)]))
    return ref


@pytest.mark.parametrize("capacity_factor,activation", [(None, "swiglu"), (0.7, "swiglu"), (None, "geglu")])
def test_matches_the_moe_with_dequantized_weights(capacity_factor, activation):
    moe = _moe(capacity_factor=capacity_factor, activation=activation)
    layer = NVFP4InferenceMoE.from_moe(moe)
    x = torch.randn(3, 5, 64)
    y, routing = layer(x, return_routing=True)
    ref, ref_routing = _dequantized_moe(moe)(x, return_routing=True)
    assert torch.equal(routing.topk_ids, ref_routing.topk_ids)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    assert y.shape == x.shape and y.dtype == x.dtype


def test_state_dict_roundtrip_in_modelopt_layout(tmp_path):
    layer = NVFP4InferenceMoE.from_moe(_moe())
    sd = layer.state_dict()
    assert sd["w1"].dtype == torch.uint8 and sd["w1"].shape == (4, 64, 32)
    assert sd["w1_scale"].dtype == torch.float8_e4m3fn and sd["w1_scale"].shape == (4, 64, 4)
    assert sd["w2"].shape == (4, 64, 16) and sd["w2_scale_2"].shape == (4,)
    assert "w1_packed" not in sd
    lowprec.save(sd, tmp_path / "moe.safetensors")
    loaded = NVFP4InferenceMoE(64, 32, 4, 2)
    loaded.load_state_dict(lowprec.load(tmp_path / "moe.safetensors"))
    x = torch.randn(6, 64)
    assert torch.equal(loaded(x), layer(x))


def test_load_rejects_missing_and_wrong_tensors():
    sd = NVFP4InferenceMoE.from_moe(_moe()).state_dict()
    layer = NVFP4InferenceMoE(64, 32, 4, 2)
    with pytest.raises(RuntimeError, match="w2_scale"):
        layer.load_state_dict({k: v for k, v in sd.items() if k != "w2_scale"})
    with pytest.raises(RuntimeError, match=r"w1: expected torch.uint8 \(4, 64, 32\), got torch.uint8 \(4, 32, 32\)"):
        layer.load_state_dict({**sd, "w1": sd["w1"][:, :32]})
    with pytest.raises(RuntimeError, match="w2_scale_2"):
        layer.load_state_dict({**sd, "w2_scale_2": torch.ones(4, dtype=torch.float64)})


@torch.no_grad()
def test_convert_makes_nvfp4_experts():
    moe = _moe()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), moe)
    x = torch.randn(4, 64)
    expect = NVFP4InferenceMoE.from_moe(moe)(model[0](x))
    lowprec.convert(model, "nvfp4", inference=True)
    assert isinstance(model[1], NVFP4InferenceMoE) and type(model[0]).__name__ == "NVFP4InferenceLinear"
    assert torch.equal(model[1].router.weight, moe.router.weight)
    assert torch.equal(model[1](model[0](x)), NVFP4InferenceMoE.from_moe(moe)(model[0](x)))
    assert not torch.equal(model[1](model[0](x)), expect)  # the linear before it is NVFP4 now too


def _modelopt_experts(moe: MoE):
    """Per expert, ModelOpt-style (weight, weight_scale, weight_scale_2) of gate, up and down; gate
    and up quantized together (one global scale), as ModelOpt exports the pair."""
    recipe = get_recipe("nvfp4")
    gate, up, down = [], [], []
    for w1, w2 in zip(moe.w1.detach(), moe.w2.detach()):
        q1, q2 = lowprec.quantize(w1, recipe), lowprec.quantize(w2, recipe)
        f = moe.ffn_size
        gate.append((q1.data[:f], q1.scale[:f], q1.global_scale.reshape(1)))
        up.append((q1.data[f:], q1.scale[f:], q1.global_scale.reshape(1)))
        down.append((q2.data, q2.scale, q2.global_scale.reshape(1)))
    return gate, up, down


def test_from_modelopt_takes_the_tensors_as_they_are():
    moe = _moe()
    gate, up, down = _modelopt_experts(moe)
    layer = NVFP4InferenceMoE.from_modelopt(moe.router.weight.detach(), gate, up, down, top_k=2)
    expect = NVFP4InferenceMoE.from_moe(moe)
    x = torch.randn(9, 64)
    assert torch.equal(layer(x), expect(x))
    sd = layer.state_dict()
    assert torch.equal(sd["w1"][1, 32:], up[1][0]) and torch.equal(sd["w2_scale"][3], down[3][1])


def test_from_modelopt_reconciles_a_gate_and_up_of_different_weight_scale_2():
    """Published ModelOpt checkpoints can hold a gate and an up with
    different weight_scale_2: the larger is kept, the other half's block scales rescaled (one
    E4M3 rounding), each half's dequantized weight kept."""
    moe = _moe()
    gate, up, down = _modelopt_experts(moe)
    up[2] = (up[2][0], up[2][1], up[2][2] * 3)  # gate's blocks now rescaled by 1/3
    with pytest.warns(UserWarning, match="1 of 4 experts"):
        layer = NVFP4InferenceMoE.from_modelopt(moe.router.weight.detach(), gate, up, down, top_k=2)

    def dequant(codes, scale, scale_2):
        e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
        vals = e2m1[torch.stack([codes & 0xF, codes >> 4], -1).flatten(-2).long()]
        return vals * scale.double().repeat_interleave(16, -1) * scale_2.double().reshape(())

    sd = layer.state_dict()
    got = dequant(sd["w1"][2], sd["w1_scale"][2], sd["w1_scale_2"][2])
    want_gate, want_up = dequant(*gate[2]), dequant(*up[2])
    assert torch.equal(got[32:], want_up)  # the half whose global scale was kept: exact
    torch.testing.assert_close(got[:32], want_gate, rtol=2.0 ** -4, atol=2.0 ** -9 * gate[2][2].item())
    assert sd["w1_scale_2"][2].item() == up[2][2].item()
    for e in (0, 1, 3):  # the matching pairs: as they are
        assert torch.equal(sd["w1"][e], torch.cat([gate[e][0], up[e][0]]))
        assert torch.equal(sd["w1_scale"][e].view(torch.uint8), torch.cat([gate[e][1], up[e][1]]).view(torch.uint8))


def test_from_modelopt_takes_a_router_dtype():
    moe = _moe()
    gate, up, down = _modelopt_experts(moe)
    layer = NVFP4InferenceMoE.from_modelopt(moe.router.weight.detach(), gate, up, down, top_k=2,
                                            dtype=torch.bfloat16)
    assert layer.router.weight.dtype == torch.bfloat16
    assert torch.equal(layer.router.weight, moe.router.weight.detach().bfloat16())


def test_from_modelopt_errors():
    moe = _moe()
    gate, up, down = _modelopt_experts(moe)
    router = moe.router.weight.detach()
    with pytest.raises(ValueError, match="gate, up, down: expected one"):
        NVFP4InferenceMoE.from_modelopt(router, gate, up[:3], down, top_k=2)
    with pytest.raises(ValueError, match=r"router_weight: expected \[E=4, H\]"):
        NVFP4InferenceMoE.from_modelopt(router[:3], gate, up, down, top_k=2)
    down[0] = down[0][:2]
    with pytest.raises(ValueError, match=r"down\[0\]: expected \(weight, weight_scale, weight_scale_2\)"):
        NVFP4InferenceMoE.from_modelopt(router, gate, up, down, top_k=2)


def test_from_modelopt_names_the_expert_whose_tensors_do_not_stack():
    """One expert's tensors of another shape used to fail in torch.stack / reshape, naming no expert."""
    moe = _moe()
    router = moe.router.weight.detach()
    gate, up, down = _modelopt_experts(moe)
    up[1] = (up[1][0][:16], up[1][1][:16], up[1][2])
    with pytest.raises(ValueError, match=r"up\[1\]: expected a weight \(32, 32\), a weight_scale \(32, 4\)"):
        NVFP4InferenceMoE.from_modelopt(router, gate, up, down, top_k=2)
    gate, up, down = _modelopt_experts(moe)
    down[3] = (down[3][0], down[3][1], torch.ones(2))
    with pytest.raises(ValueError, match=r"down\[3\]: .*one-element weight_scale_2"):
        NVFP4InferenceMoE.from_modelopt(router, gate, up, down, top_k=2)


def test_errors():
    with pytest.raises(TypeError, match="moe: expected a lowprec.moe.MoE"):
        NVFP4InferenceMoE.from_moe(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="hidden_size: must be a multiple of 16 for NVFP4 experts"):
        NVFP4InferenceMoE(40, 32, 4, 2)  # not a multiple of 16 (the error said FP8's recipe)
    with pytest.raises(ValueError, match="ffn_size: must be a multiple of 16 for NVFP4 experts"):
        NVFP4InferenceMoE(64, 24, 4, 2)
    layer = NVFP4InferenceMoE(64, 32, 4, 2)
    with pytest.raises(ValueError, match=r"x: expected a float32/bfloat16/float16 tensor \[..., H=64\]"):
        layer(torch.randn(3, 32))
    with pytest.raises(RuntimeError, match="x: NVFP4InferenceMoE is not differentiable in x"):
        layer(torch.randn(3, 64, requires_grad=True))
    with torch.no_grad():
        layer(torch.randn(3, 64, requires_grad=True))
    with pytest.raises(ValueError, match="name: expected one of"):
        layer.set_weights("w3", *[torch.zeros(1)] * 3)
    with pytest.raises(ValueError, match="w2_scale_2: expected torch.float32"):
        layer.set_weights("w2", torch.zeros(4, 64, 16, dtype=torch.uint8),
                          torch.zeros(4, 64, 2).to(torch.float8_e4m3fn), torch.ones(3))


def test_casts_keep_the_nvfp4_buffers():
    layer = NVFP4InferenceMoE.from_moe(_moe()).to(torch.bfloat16)
    assert layer.w1_packed.dtype == torch.uint8 and layer.w1_scale_2.dtype == torch.float32
    assert layer.router.weight.dtype == torch.bfloat16
    assert layer(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_compiled_fullgraph_equals_eager():
    layer = NVFP4InferenceMoE.from_moe(_moe(capacity_factor=0.8))
    x = torch.randn(2, 7, 64)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x), layer(x))


def test_empty_batch():
    layer = NVFP4InferenceMoE.from_moe(_moe())
    assert layer(torch.randn(0, 64)).shape == (0, 64)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tokens,experts,top_k,capacity_factor", [
    (1, 64, 8, None), (4, 64, 8, None), (16, 8, 2, None), (200, 16, 4, None), (32, 8, 2, 0.5),
])
def test_kernel_layer_matches_the_reference_path(tokens, experts, top_k, capacity_factor, monkeypatch):
    """bf16 tokens on the grouped kernel (``LOWPREC_BACKEND=kernel``: no fallback) against the same
    layer's reference path on the CPU, and CUDA-graph replay equal to eager."""
    moe = _moe(hidden=1024, ffn=512, experts=experts, top_k=top_k, capacity_factor=capacity_factor)
    cpu_layer = NVFP4InferenceMoE.from_moe(moe).to(torch.bfloat16)
    layer = NVFP4InferenceMoE.from_moe(moe).to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, 1024, dtype=torch.bfloat16)
    ref = cpu_layer(x)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    y = layer(x.cuda())
    # the same routing; bf16 GEMM outputs on both paths (the kernel's FP32 sums, then one rounding)
    err = (y.float().cpu() - ref.float()).norm() / ref.float().norm()
    assert err < 1e-2, err.item()
    xg = x.cuda()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = layer(xg)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, y)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # warm-up, capture, replay
        yc = compiled(xg)
    assert torch.equal(yc, y)


def test_quantize_nvfp4_experts_refuses_a_2d_weight():
    from lowprec.moe.nvfp4 import quantize_nvfp4_experts

    with pytest.raises(ValueError, match=r"w: expected a float tensor \[E, N, K\]"):
        quantize_nvfp4_experts(torch.randn(32, 64))


def test_nvfp4_moe_layer_fake_strides_of_a_transposed_input():
    torch.manual_seed(0)
    layer = NVFP4InferenceMoE.from_moe(MoE(64, 64, 8, 2))
    x = torch.randn(64, 40).t()
    args = (x, layer.router.weight.detach(), layer.w1_packed, layer.w1_scale_2, layer.w2_packed, layer.w2_scale_2,
            64, 2, "softmax", True, None, "probs", "swiglu")
    torch.library.opcheck(torch.ops.lowprec.nvfp4_moe_layer.default, args,
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_a_reload_writes_into_the_buffers_the_layer_has():
    """As NVFP4InferenceLinear's: a reload keeps the buffers (CUDA graphs captured before read them)."""
    layer, other = NVFP4InferenceMoE.from_moe(_moe(seed=0)), NVFP4InferenceMoE.from_moe(_moe(seed=1))
    buffers = {name: b for name, b in layer.named_buffers()}
    layer.load_state_dict(other.state_dict())
    assert all(b is buffers[name] for name, b in layer.named_buffers())
    x = torch.randn(6, 64)
    assert torch.equal(layer(x), other(x))
    layer.load_state_dict(other.state_dict(), assign=True)
    assert layer.w1_packed is not buffers["w1_packed"]


def test_a_data_assignment_reaches_the_kernels_view():
    """``buffer.data = ...`` keeps the buffer tensor but not its storage: the tile view the grouped
    kernel reads (made at an earlier forward) must follow it."""
    layer, other = NVFP4InferenceMoE.from_moe(_moe(seed=0)), NVFP4InferenceMoE.from_moe(_moe(seed=1))
    assert not torch.equal(layer.packed_weights()[0].tiles, other.packed_weights()[0].tiles)
    for name in ("w1_packed", "w1_scale_2", "w2_packed", "w2_scale_2"):
        getattr(layer, name).data = getattr(other, name).clone()
    for mine, theirs in zip(layer.packed_weights(), other.packed_weights()):
        assert torch.equal(mine.tiles, theirs.tiles) and torch.equal(mine.global_scale, theirs.global_scale)
