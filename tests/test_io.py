import json

import pytest
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


@pytest.mark.gpu
def test_load_to_cuda(tmp_path):
    qt = lowprec.quantize(torch.randn(8, 256, device="cuda"), "mxfp8")
    lowprec.save(qt, tmp_path / "t.safetensors")
    back = lowprec.load(tmp_path / "t.safetensors", device="cuda")
    assert back.device.type == "cuda" and torch.equal(back.dequantize(), qt.dequantize())
