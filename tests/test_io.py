import json

import pytest
import safetensors
import safetensors.torch
import torch

import lowprec
from lowprec.recipes import RECIPE_NAMES


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_quantized_tensor_roundtrip(name, tmp_path):
    x = torch.randn(40, 300, dtype=torch.bfloat16)
    qt = lowprec.quantize(x, name)
    path = tmp_path / "t.safetensors"
    lowprec.save(qt, path)
    back = lowprec.load(path)
    assert isinstance(back, lowprec.QuantizedTensor)
    assert back.recipe == qt.recipe and back.shape == qt.shape and back.dtype == torch.bfloat16
    assert back.data.dtype == qt.data.dtype and torch.equal(back.data.view(torch.uint8), qt.data.view(torch.uint8))
    assert torch.equal(back.scale.float(), qt.scale.float())
    assert torch.equal(back.dequantize(), qt.dequantize())


def test_state_dict_roundtrip_with_options_and_metadata(tmp_path):
    sd = {
        "layer.weight": lowprec.quantize(torch.randn(256, 256), "fp8_block128x128", pow2_scale=True),
        "layer.bias": torch.randn(256),
        "moe.w1": lowprec.quantize(torch.randn(4, 64, 128), "nvfp4", weight_2d=True),
        "step": torch.tensor(7),
    }
    path = tmp_path / "sd.safetensors"
    lowprec.save(sd, path, metadata={"model": "tiny"})
    back = lowprec.load(path)
    assert set(back) == set(sd)
    assert torch.equal(back["layer.bias"], sd["layer.bias"]) and back["step"].item() == 7
    for key in ("layer.weight", "moe.w1"):
        assert back[key].recipe == sd[key].recipe
        assert torch.equal(back[key].dequantize(), sd[key].dequantize())
    with safetensors.safe_open(path, "pt") as f:
        assert f.metadata()["model"] == "tiny"


def test_missing_recipe_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.safetensors"
    safetensors.torch.save_file({"w::data": torch.zeros(4, dtype=torch.uint8), "w::scale": torch.ones(1)}, path)
    with pytest.raises(ValueError, match="'w' has no recipe"):
        lowprec.load(path)


def test_unknown_recipe_is_a_clear_error(tmp_path):
    qt = lowprec.quantize(torch.randn(4, 128), "fp8_block1x128")
    path = tmp_path / "t.safetensors"
    lowprec.save({"w": qt}, path)
    with safetensors.safe_open(path, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    info = json.loads(meta["lowprec.quantized"])
    info["w"]["recipe"]["elem_format"] = "e3m4"
    meta["lowprec.quantized"] = json.dumps(info)
    safetensors.torch.save_file(tensors, path, metadata=meta)
    with pytest.raises(ValueError, match="unknown recipe"):
        lowprec.load(path)


def test_save_errors(tmp_path):
    with pytest.raises(TypeError, match="obj"):
        lowprec.save([1, 2], tmp_path / "x")
    with pytest.raises(ValueError, match="reserved"):
        lowprec.save({"a": torch.ones(1)}, tmp_path / "x", metadata={"lowprec.kind": "x"})
    with pytest.raises(ValueError, match="'::'"):
        lowprec.save({"a::b": torch.ones(1)}, tmp_path / "x")


@pytest.mark.parametrize("metadata", [[("model", "tiny")], "model=tiny"])
def test_save_refuses_metadata_that_is_not_a_dict_naming_it(metadata, tmp_path):
    with pytest.raises(TypeError, match="metadata: expected a dict"):
        lowprec.save({"a": torch.ones(1)}, tmp_path / "x", metadata=metadata)


@pytest.mark.gpu
def test_load_to_cuda(tmp_path):
    qt = lowprec.quantize(torch.randn(8, 256, device="cuda"), "mxfp8")
    lowprec.save(qt, tmp_path / "t.safetensors")
    back = lowprec.load(tmp_path / "t.safetensors", device="cuda")
    assert back.device.type == "cuda" and torch.equal(back.dequantize(), qt.dequantize())


def _damaged(tmp_path, edit_meta=None, edit_tensors=None, obj=None):
    """A file saved by lowprec, then its metadata / tensors edited in place."""
    path = tmp_path / "d.safetensors"
    lowprec.save(obj if obj is not None else {"w": lowprec.quantize(torch.randn(4, 256), "nvfp4"),
                                              "b": torch.ones(3)}, path)
    with safetensors.safe_open(path, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    info = json.loads(meta["lowprec.quantized"])
    if edit_meta:
        edit_meta(meta, info)
    meta["lowprec.quantized"] = info if isinstance(info, str) else json.dumps(info)
    if edit_tensors:
        edit_tensors(tensors)
    safetensors.torch.save_file(tensors, path, metadata=meta)
    return path


def _set(*keys, value=None, delete=False):
    def edit(meta, info):
        d = info
        for k in keys[:-1]:
            d = d[k]
        if delete:
            del d[keys[-1]]
        else:
            d[keys[-1]] = value
    return edit


@pytest.mark.parametrize("edit_meta, edit_tensors, match", [
    (_set("w", "shape", delete=True), None, "entry 'w'.*'shape'"),
    (_set("w", "shape", value=[4, 300]), None, "entry 'w'.*data: expected shape"),
    (_set("w", "shape", value="4x256"), None, "entry 'w'.*'shape'"),
    (_set("w", "dtype", value="int8"), None, "entry 'w'.*dtype"),
    (_set("w", "dtype", delete=True), None, "entry 'w'.*dtype"),
    (_set("w", "recipe", "block", value=[1, 32]), None, "entry 'w'.*recipe"),
    (lambda meta, info: info["w"]["recipe"].update(name="my_fp4", block=[1, 8]), None,
     "entry 'w'.*scale: expected a"),
    (_set("w", value=[1, 2]), None, "entry 'w'.*JSON object"),
    (_set("w", "recipe", "global_scale", value=False), None, "entry 'w'"),
    (None, lambda t: t.pop("w::data"), "entry 'w'.*'w::data'"),
    (None, lambda t: t.pop("w::global_scale"), "entry 'w'.*global scale"),
    (None, lambda t: t.update({"w::bias": torch.ones(1)}), "'w::bias'"),
    (None, lambda t: t.update({"v::data": torch.ones(1)}), "entry 'v'.*no recipe"),
    (_set("x", value={"recipe": {}}), None, "entry 'x'.*no tensors"),
    (lambda meta, info: meta.update({"lowprec.format_version": "2"}), None, "'lowprec.format_version'"),
    (lambda meta, info: meta.update({"lowprec.kind": "model"}), None, "'lowprec.kind'"),
    (lambda meta, info: meta.update({"lowprec.kind": "quantized_tensor"}), None, "'lowprec.kind'.*'tensor'"),
    (lambda meta, info: info.clear() or info.update({"w": 1}) or None, None, "entry 'w'.*JSON object"),
])
def test_damaged_metadata_is_one_value_error_naming_the_key(tmp_path, edit_meta, edit_tensors, match):
    path = _damaged(tmp_path, edit_meta, edit_tensors)
    with pytest.raises(ValueError, match=match):
        lowprec.load(path)


def test_quantized_metadata_must_be_a_json_object(tmp_path):
    path = _damaged(tmp_path, lambda meta, info: None)
    with safetensors.safe_open(path, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    meta["lowprec.quantized"] = "[1, 2]"
    safetensors.torch.save_file(tensors, path, metadata=meta)
    with pytest.raises(ValueError, match="'lowprec.quantized'.*JSON object"):
        lowprec.load(path)


def test_plain_safetensors_file_loads(tmp_path):
    path = tmp_path / "plain.safetensors"
    safetensors.torch.save_file({"a": torch.ones(2)}, path)
    assert torch.equal(lowprec.load(path)["a"], torch.ones(2))


def test_tied_weights_are_saved_once_and_stay_tied(tmp_path):
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32, bias=False))
    model[1].weight = model[0].weight
    sd = dict(model.state_dict())
    sd["q"] = lowprec.quantize(torch.randn(16, 128), "fp8_block1x128")
    sd["q_again"] = sd["q"]
    sd["row"] = model[0].weight.detach()[3]  # a view into a tied tensor: stored on its own
    path = tmp_path / "tied.safetensors"
    lowprec.save(sd, path)
    back = lowprec.load(path)
    assert set(back) == set(sd)
    assert back["1.weight"].data_ptr() == back["0.weight"].data_ptr()
    assert torch.equal(back["0.weight"], model[0].weight) and torch.equal(back["row"], sd["row"])
    assert back["q_again"].data.data_ptr() == back["q"].data.data_ptr()
    fresh = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32, bias=False))
    fresh.load_state_dict({k: v for k, v in back.items() if "q" not in k and k != "row"})
    assert torch.equal(fresh[1].weight, model[1].weight)


def test_alias_to_a_missing_tensor_is_a_clear_error(tmp_path):
    t = torch.ones(4)
    path = _damaged(tmp_path, lambda meta, info: meta.update({"lowprec.aliases": json.dumps({"c": "zz"})}),
                    obj={"a": t, "b": t})
    with pytest.raises(ValueError, match="'lowprec.aliases'.*'c'.*'zz'"):
        lowprec.load(path)


def test_keys_ending_with_a_colon_round_trip(tmp_path):
    """save refuses only '::' in a key; a key ending in ':' makes part names such as 'w:::data',
    which load must split at the last '::'."""
    sd = {"w:": lowprec.quantize(torch.randn(4, 64), "nvfp4"), ":": lowprec.quantize(torch.randn(2, 32), "mxfp8"),
          "b:": torch.ones(3)}
    path = tmp_path / "colon.safetensors"
    lowprec.save(sd, path)
    back = lowprec.load(path)
    assert set(back) == set(sd)
    for key in ("w:", ":"):
        assert back[key].recipe == sd[key].recipe
        assert torch.equal(back[key].dequantize(), sd[key].dequantize())
    assert torch.equal(back["b:"], sd["b:"])


def test_tied_weights_stay_tied_when_each_name_would_be_copied(tmp_path, monkeypatch):
    """Ties are found before .contiguous() / .cpu(): for a non-contiguous tensor, and for a CUDA
    one (simulated: Tensor.cpu() returning a copy, as it does for a CUDA tensor), each name's
    copy would otherwise hide that the names are one tensor."""
    w = torch.randn(16, 8).t()  # tied, non-contiguous
    lowprec.save({"emb": w, "head": w}, tmp_path / "a.safetensors")
    back = lowprec.load(tmp_path / "a.safetensors")
    assert back["emb"].data_ptr() == back["head"].data_ptr() and torch.equal(back["head"], w)

    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: real_cpu(self, *a, **k).clone())
    v = torch.randn(8, 8)
    q = lowprec.quantize(torch.randn(16, 128), "fp8_block1x128")
    row = v[3]  # a view into the tied tensor: stored on its own
    lowprec.save({"emb": v, "head": v, "row": row, "q": q, "q_again": q}, tmp_path / "b.safetensors")
    monkeypatch.undo()
    back = lowprec.load(tmp_path / "b.safetensors")
    assert back["emb"].data_ptr() == back["head"].data_ptr() and torch.equal(back["emb"], v)
    assert torch.equal(back["row"], row) and back["row"].data_ptr() != back["emb"].data_ptr()
    assert back["q"].data.data_ptr() == back["q_again"].data.data_ptr()
    assert torch.equal(back["q_again"].dequantize(), q.dequantize())


@pytest.mark.parametrize("device", ["cpu", "cpu:0", torch.device("cpu"), torch.device("cpu", 0)])
def test_load_takes_the_cpu_devices_torch_takes(device, tmp_path):
    qt = lowprec.quantize(torch.randn(8, 256), "mxfp8")
    lowprec.save({"q": qt, "w": torch.ones(3)}, tmp_path / "t.safetensors")
    back = lowprec.load(tmp_path / "t.safetensors", device=device)
    assert back["q"].device.type == "cpu" and torch.equal(back["q"].dequantize(), qt.dequantize())
    assert torch.equal(back["w"], torch.ones(3))


@pytest.mark.parametrize("device, expected", [
    ("cuda", "cuda"), ("cuda:1", "cuda:1"), (torch.device("cuda", 0), "cuda:0"), ("cpu:0", "cpu"),
    # torch.device(1) is the accelerator's device 1: without one, torch itself refuses it
    pytest.param(1, "cuda:1", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_load_gives_safetensors_the_device_as_it_names_it(device, expected, tmp_path, monkeypatch):
    """The forms torch takes reach safe_open as "cpu", "cuda", "cuda:N" (it refuses "cpu:0", "0")."""
    lowprec.save({"w": torch.ones(3)}, tmp_path / "t.safetensors")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen = []
    real_open = safetensors.safe_open

    def safe_open(path, framework, device):
        seen.append(device)
        return real_open(path, framework=framework, device="cpu")

    monkeypatch.setattr(safetensors, "safe_open", safe_open)
    lowprec.load(tmp_path / "t.safetensors", device=device)
    assert seen == [expected]


@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda", 0)])
def test_load_to_cuda_without_cuda_names_device(device, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lowprec.save({"w": torch.ones(3)}, tmp_path / "t.safetensors")
    with pytest.raises(ValueError, match="device"):
        lowprec.load(tmp_path / "t.safetensors", device=device)


@pytest.mark.parametrize("device", ["cuda0", 1.5, None])
def test_load_refuses_what_torch_refuses_naming_device(device, tmp_path):
    lowprec.save({"w": torch.ones(3)}, tmp_path / "t.safetensors")
    with pytest.raises(ValueError, match="device"):
        lowprec.load(tmp_path / "t.safetensors", device=device)


def test_save_takes_fp8_all_gather_parameters(tmp_path):
    """Parameters wrapped by enable_fp8_all_gather, saved as named_parameters() gives them (not
    through state_dict()), are saved as the master weights they wrap."""
    layers = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 128))
    model = lowprec.nn.convert(layers, "fp8_block", min_weight_numel=0)
    model[1].weight = model[0].weight  # tied: stored once
    assert lowprec.nn.enable_fp8_all_gather(model) == 1  # the tied weight is wrapped once
    params = dict(model.named_parameters(remove_duplicate=False))
    lowprec.save(params, tmp_path / "p.safetensors")
    back = lowprec.load(tmp_path / "p.safetensors")
    assert back.keys() == params.keys() and all(type(t) is torch.Tensor for t in back.values())
    assert torch.equal(back["0.weight"], model[0].weight.hp) and torch.equal(back["1.bias"], model[1].bias)
    assert back["1.weight"] is back["0.weight"]


@pytest.mark.parametrize("obj", [{"w": torch.ones(3)}, lowprec.quantize(torch.randn(4, 64), "mxfp8")])
def test_saved_file_says_format_pt_as_save_pretrained_does(obj, tmp_path):
    """transformers 4's from_pretrained (and loaders written after it) refuse a safetensors file whose
    metadata has no "format"."""
    lowprec.save(obj, tmp_path / "t.safetensors", metadata={"model": "tiny"})
    with safetensors.safe_open(tmp_path / "t.safetensors", "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and meta["model"] == "tiny" and meta["lowprec.format_version"] == "1"
    lowprec.save(obj, tmp_path / "u.safetensors", metadata={"format": "custom"})  # the caller's own value kept
    with safetensors.safe_open(tmp_path / "u.safetensors", "pt") as f:
        assert f.metadata()["format"] == "custom"
    assert type(lowprec.load(tmp_path / "u.safetensors")) is type(obj)
