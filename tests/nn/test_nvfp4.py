"""NVFP4InferenceLinear: weight-only NVFP4 layers, convert(..., "nvfp4", inference=True), and
ModelOpt NVFP4 checkpoints loaded as they are published (CPU: the layer has no kernel yet)."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import lowprec
from lowprec.nn import FP8Linear, NVFP4InferenceLinear, convert

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _modelopt_tensors(out_features, in_features, seed=0):
    """One linear's tensors in ModelOpt's NVFP4 export layout, built from codes and scales chosen
    here (so the expected weight is known exactly): packed codes (element 2i in the low nibble),
    E4M3 scales per 16, FP32 global scale as a [1] tensor, input_scale."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.uint8)
    scale = (2.0 ** torch.randint(-6, 4, (out_features, in_features // 16), generator=g)).to(torch.float8_e4m3fn)
    global_scale = torch.tensor([0.0375])
    packed = (codes[:, 1::2] << 4) | codes[:, 0::2]
    weight = E2M1[codes.long()] * scale.float().repeat_interleave(16, 1) * global_scale
    tensors = {"weight": packed, "weight_scale": scale, "weight_scale_2": global_scale,
               "input_scale": torch.tensor([0.5])}
    return tensors, weight


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 96)
        self.down = nn.Linear(96, 32, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_from_linear_is_the_nvfp4_weight_times_x():
    torch.manual_seed(0)
    ref = nn.Linear(64, 48)
    layer = NVFP4InferenceLinear.from_linear(ref)
    x = torch.randn(5, 7, 64)
    w_q = lowprec.quantize(ref.weight.detach(), "nvfp4")
    torch.testing.assert_close(layer(x), x @ w_q.dequantize(torch.float32).t() + ref.bias.detach(), rtol=0, atol=0)
    err = (layer(x) - ref(x)).norm() / ref(x).norm()
    assert 0 < err < 0.15  # NVFP4's own error, no more
    stored = sum(b.numel() * b.element_size() for b in (layer.weight, layer.weight_scale))
    assert stored == 48 * 64 // 2 + 48 * 64 // 16  # 4.5 bits per weight


def test_modelopt_checkpoint_loads_as_published(tmp_path):
    """A converted model takes a ModelOpt NVFP4 safetensors file with load_state_dict(strict)."""
    up, w_up = _modelopt_tensors(96, 64, seed=1)
    down, w_down = _modelopt_tensors(32, 96, seed=2)
    bias = torch.randn(96)
    state = {**{f"up.{k}": v for k, v in up.items()}, "up.bias": bias, **{f"down.{k}": v for k, v in down.items()}}
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    model = convert(Mlp().float(), "nvfp4", inference=True)
    assert isinstance(model.up, NVFP4InferenceLinear) and isinstance(model.down, NVFP4InferenceLinear)
    model.load_state_dict(load_file(str(path)))
    x = torch.randn(3, 64)
    want = torch.relu(x @ w_up.t() + bias) @ w_down.t()
    torch.testing.assert_close(model(x), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(model.up.weight, up["weight"]) and model.up.weight_scale_2.dim() == 0
    assert model.up.input_scale.item() == 0.5  # kept for W4A4 engines, unused here
    one = NVFP4InferenceLinear.from_modelopt(**down, out_dtype=torch.float32)
    torch.testing.assert_close(one(x[:, :32].repeat(1, 3)), x[:, :32].repeat(1, 3) @ w_down.t(), rtol=1e-6,
                               atol=1e-6)


def test_a_tied_head_stays_tied_through_a_modelopt_load():
    """README: a tied model's checkpoint has no lm_head.weight; with strict=False that is the only
    missing key and the kept (excluded) head reads the loaded embedding."""
    model = nn.Module()
    model.embed, model.proj = nn.Embedding(16, 64), nn.Linear(64, 32, bias=False)
    model.lm_head = nn.Linear(64, 16, bias=False)
    model.lm_head.weight = model.embed.weight
    convert(model, "nvfp4", inference=True, filter_fn=lambda name, module: name != "lm_head")
    tensors, w = _modelopt_tensors(32, 64, seed=5)
    embedding = torch.randn(16, 64)
    result = model.load_state_dict({"embed.weight": embedding, **{f"proj.{n}": t for n, t in tensors.items()}},
                                   strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys
    assert model.lm_head.weight is model.embed.weight and torch.equal(model.lm_head.weight, embedding)
    x = torch.randn(3, 64)
    torch.testing.assert_close(model.proj(x), x @ w.t(), rtol=1e-6, atol=1e-6)


def test_modelopt_kv_cache_scales_and_weight_only_layers_load_strictly():
    """ModelOpt writes FP8 KV-cache scales as k_proj.k_scale / v_proj.v_scale, and no input_scale
    for weight-only (W4A16_NVFP4) layers: both load with strict=True."""
    attn = nn.Module()
    attn.k_proj, attn.v_proj = nn.Linear(64, 32, bias=False), nn.Linear(64, 32, bias=False)
    k, w_k = _modelopt_tensors(32, 64, seed=3)
    v, w_v = _modelopt_tensors(32, 64, seed=4)
    del v["input_scale"]
    state = {**{f"k_proj.{n}": t for n, t in k.items()}, "k_proj.k_scale": torch.tensor(0.02),
             **{f"v_proj.{n}": t for n, t in v.items()}, "v_proj.v_scale": torch.tensor(0.03)}
    model = convert(attn, "nvfp4", inference=True)
    model.load_state_dict(state)
    x = torch.randn(3, 64)
    torch.testing.assert_close(model.k_proj(x), x @ w_k.t(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model.v_proj(x), x @ w_v.t(), rtol=1e-6, atol=1e-6)
    meta = NVFP4InferenceLinear.from_linear(nn.Linear(64, 32, bias=False, device="meta"))
    meta.load_state_dict(v, assign=True)  # a skeleton: input_scale made where the weight is
    assert meta.input_scale.device.type == "cpu" and meta.input_scale.item() == 1.0
    torch.testing.assert_close(meta(x), x @ w_v.t(), rtol=1e-6, atol=1e-6)


def test_save_load_roundtrip_and_casts(tmp_path):
    torch.manual_seed(1)
    model = convert(Mlp().to(torch.bfloat16), "nvfp4", inference=True)
    path = tmp_path / "m.safetensors"
    lowprec.save(model.state_dict(), str(path))
    fresh = convert(Mlp().to(torch.bfloat16), "nvfp4", inference=True)
    fresh.load_state_dict(lowprec.load(str(path)))
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert torch.equal(fresh(x), model(x)) and model(x).dtype == torch.bfloat16
    fresh.half()  # module casts keep the NVFP4 buffers
    assert fresh.up.weight.dtype == torch.uint8 and fresh.up.weight_scale.dtype == torch.float8_e4m3fn
    assert fresh.up.bias.dtype == torch.float16
    with torch.autocast("cpu", torch.bfloat16):
        assert convert(Mlp(), "nvfp4", inference=True)(torch.randn(2, 64)).dtype == torch.bfloat16


def test_convert_from_a_trained_fp8_model_and_errors():
    torch.manual_seed(2)
    trained = convert(Mlp(), min_weight_numel=0)
    assert isinstance(trained.up, FP8Linear)
    master = trained.up.weight.detach().clone()
    infer = convert(trained, "nvfp4", inference=True)  # from the master weights (in place)
    assert isinstance(infer.up, NVFP4InferenceLinear)
    w_q = lowprec.quantize(master, "nvfp4")
    assert torch.equal(infer.up.weight, w_q.data)
    with pytest.raises(ValueError, match="weight-only inference format"):
        convert(Mlp(), "nvfp4")
    with pytest.raises(ValueError, match="in_features: must be a positive multiple of 16"):
        NVFP4InferenceLinear(40, 16)
    with pytest.raises(ValueError, match="weight: expected a uint8"):
        NVFP4InferenceLinear.from_modelopt(torch.zeros(16, 8), torch.zeros(16, 1), torch.ones(()))
    layer = NVFP4InferenceLinear(64, 16)
    with pytest.raises(RuntimeError, match="weight: expected torch.uint8"):
        layer.load_state_dict({**layer.state_dict(), "weight": torch.zeros(16, 32)})
    with pytest.raises(ValueError, match="in_features=64"):
        layer(torch.randn(2, 32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_forward_is_cuda_graph_capturable():
    """No host sync or host-to-device copy per call (the E2M1 table was copied and the codes'
    range read back every call: capture failed)."""
    lin = nn.Linear(512, 384, device="cuda", dtype=torch.bfloat16)
    layer = NVFP4InferenceLinear.from_linear(lin)
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = layer(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(x)  # warm-up on the capture stream
            with torch.cuda.graph(graph, stream=stream):
                out = layer(x)
        torch.cuda.current_stream().wait_stream(stream)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.equal(out, eager) and torch.equal(out, layer(x))


def test_the_layer_holds_the_weight_once():
    """In memory only the kernel's layout (4.5 bits per weight, tiles padded); the state dict
    rebuilds ModelOpt's tensors from it, and loading them packs them again."""
    torch.manual_seed(4)
    layer = NVFP4InferenceLinear.from_linear(nn.Linear(256, 128, bias=False))
    held = sum(b.numel() * b.element_size() for b in layer.buffers())
    assert held == layer.packed.numel() + 8 == 128 * 256 // 2 + 128 * 256 // 16 + 8  # + two FP32 scalars
    state = layer.state_dict()
    assert set(state) == {"weight", "weight_scale", "weight_scale_2", "input_scale"}
    w_q = lowprec.quantize(nn.Linear(256, 128, bias=False).weight.detach(), "nvfp4")  # any other weight
    fresh = NVFP4InferenceLinear(256, 128, bias=False)
    fresh.load_state_dict({**state, "weight": w_q.data, "weight_scale": w_q.scale})
    assert torch.equal(fresh.weight, w_q.data) and torch.equal(fresh.packed_weight().data, fresh.packed)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.packed, layer.packed)
    with pytest.raises(RuntimeError, match="Missing key"):
        fresh.load_state_dict({k: v for k, v in state.items() if k != "weight_scale"})


def test_packed_weight_views_follow_the_buffers():
    """The kernel-layout views are made once (the eager launch path reuses them), show in-place
    updates, and are made again when a buffer is replaced (a load into new tensors, a device move)."""
    torch.manual_seed(5)
    layer = NVFP4InferenceLinear.from_linear(nn.Linear(128, 64, bias=False))
    first = layer.packed_weight()
    assert layer.packed_weight() is first and first.tiles.data_ptr() == layer.packed.data_ptr()
    x = torch.randn(3, 128)
    before = layer(x)
    layer.weight_scale_2.mul_(2)  # in place: the cached view sees it
    torch.testing.assert_close(layer(x), 2 * before, rtol=0, atol=0)
    layer.weight_scale_2 = torch.tensor(0.5) * layer.weight_scale_2  # replaced: a new view
    assert layer.packed_weight() is not first
    torch.testing.assert_close(layer(x), before, rtol=0, atol=0)
    other = NVFP4InferenceLinear.from_linear(nn.Linear(128, 64, bias=False))
    layer.packed, layer.weight_scale_2 = other.packed.clone(), other.weight_scale_2.clone()
    torch.testing.assert_close(layer(x), other(x), rtol=0, atol=0)
    third = NVFP4InferenceLinear.from_linear(nn.Linear(128, 64, bias=False))
    assert layer.packed_weight().tiles.data_ptr() == layer.packed.data_ptr()  # the view a GPU call makes
    # `.data` assigned: the same tensors on new storage (the views read the old storage before)
    layer.packed.data, layer.weight_scale_2.data = third.packed.clone(), third.weight_scale_2.clone()
    view = layer.packed_weight()
    assert view.tiles.data_ptr() == layer.packed.data_ptr()
    assert view.global_scale.data_ptr() == layer.weight_scale_2.data_ptr()
    torch.testing.assert_close(layer(x), third(x), rtol=0, atol=0)


def test_weight_scale_2_of_a_wrong_shape_is_a_clear_load_error():
    state = NVFP4InferenceLinear.from_linear(nn.Linear(64, 32)).state_dict()
    with pytest.raises(RuntimeError, match="size mismatch for weight_scale_2"):
        NVFP4InferenceLinear(64, 32).load_state_dict({**state, "weight_scale_2": torch.ones(2)})


def test_a_weight_of_a_wrong_shape_is_named_at_load():
    state = NVFP4InferenceLinear.from_linear(nn.Linear(64, 32)).state_dict()
    with pytest.raises(RuntimeError, match=r"weight: expected \[32, 32\] packed codes, got \(32, 16\)"):
        NVFP4InferenceLinear(64, 32).load_state_dict({**state, "weight": torch.zeros(32, 16, dtype=torch.uint8)})


def test_nvfp4_layer_on_meta_loads_with_assign():
    src = NVFP4InferenceLinear.from_linear(nn.Linear(256, 128))
    layer = NVFP4InferenceLinear(256, 128, device="meta", out_dtype=torch.float32)
    layer.load_state_dict(src.state_dict(), assign=True)
    assert layer.packed.device.type == "cpu" and layer.weight_scale_2.device.type == "cpu"
    x = torch.randn(3, 256)
    assert torch.equal(layer(x), src(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inference_layers_built_under_inference_mode_decode():
    """Layers converted inside torch.inference_mode hold inference tensors (no version counter):
    the weight-only decode path keys its packed copy and the host copy of the global scale on
    versions, and raised on them."""
    torch.manual_seed(7)
    lin = nn.Linear(512, 384, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        for make in (NVFP4InferenceLinear.from_linear, lowprec.nn.FP8InferenceLinear.from_linear):
            layer = make(lin)
            got = layer(x)
            want = x.double() @ layer.quantized_weight().dequantize(torch.float64).T + lin.bias.double()
            assert lowprec.metrics.rel_l2(got, want) < 1e-2, make
            assert torch.equal(layer(x), got)


def test_a_reload_writes_into_the_buffers_the_layer_has():
    """load_state_dict replaced the packed buffers: a CUDA graph captured before a reload (new
    weights pushed into an inference model) kept reading the old weights. It copies into them, as
    torch does for parameters; assign=True takes the checkpoint's tensors."""
    torch.manual_seed(0)
    layer = NVFP4InferenceLinear.from_linear(nn.Linear(64, 32))
    other = NVFP4InferenceLinear.from_linear(nn.Linear(64, 32))
    buffers = {name: b for name, b in layer.named_buffers()}
    layer.load_state_dict(other.state_dict())
    assert all(b is buffers[name] for name, b in layer.named_buffers())
    x = torch.randn(4, 64)
    assert torch.equal(layer(x), other(x))
    layer.set_weight(*(layer.state_dict()[k] for k in ("weight", "weight_scale", "weight_scale_2")))
    assert layer.packed is buffers["packed"]
    layer.load_state_dict(NVFP4InferenceLinear.from_linear(nn.Linear(64, 32)).state_dict(), assign=True)
    assert layer.packed is not buffers["packed"]
