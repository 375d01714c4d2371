import copy
import pickle
import re

import pytest
import torch

import lowprec


@pytest.mark.parametrize("recipe", ["fp8_block128x128", "fp8_tensorwise"])
@pytest.mark.parametrize("shape", [(200, 136), (3, 200, 136)])
def test_transpose_equals_quantizing_the_transpose(recipe, shape):
    x = torch.randn(*shape) * torch.exp(torch.randn(*shape[:-1], 1))
    qt = lowprec.quantize(x, recipe)
    assert qt.transposable
    t = qt.transpose()
    ref = lowprec.quantize(x.transpose(-1, -2), recipe)
    assert t.shape == ref.shape
    assert torch.equal(t.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(t.scale, ref.scale)


@pytest.mark.parametrize("recipe", ["fp8_block1x128", "fp8_rowwise", "mxfp8", "nvfp4"])
def test_transpose_refuses_non_square_blocks(recipe):
    qt = lowprec.quantize(torch.randn(32, 64), recipe)
    assert not qt.transposable
    with pytest.raises(ValueError, match="requantize"):
        qt.transpose()


def _parts(recipe="fp8_block1x128", shape=(4, 256)):
    qt = lowprec.quantize(torch.randn(*shape), recipe)
    return qt, dict(data=qt.data, scale=qt.scale, recipe=qt.recipe, shape=qt.shape, dtype=qt.dtype,
                    global_scale=qt.global_scale)


@pytest.mark.parametrize("recipe", lowprec.RECIPE_NAMES)
@pytest.mark.parametrize("shape", [(300,), (5, 33), (2, 3, 40), (0, 64), (3, 0)])
def test_constructor_accepts_what_quantize_makes(recipe, shape):
    if lowprec.get_recipe(recipe).is_2d and len(shape) < 2:
        return
    qt, parts = _parts(recipe, shape)
    assert lowprec.QuantizedTensor(**parts).shape == qt.shape


@pytest.mark.parametrize("field, value, error, match", [
    ("data", torch.zeros(4, 256), TypeError, "data: expected torch.float8_e4m3fn"),
    ("data", torch.zeros(4, 128, dtype=torch.float8_e4m3fn), ValueError, r"data: expected shape \(4, 256\)"),
    ("data", [1, 2], TypeError, "data: expected a torch.Tensor"),
    ("scale", torch.ones(4, 3), ValueError, r"scale: expected a \(4, 2\) scale grid"),
    ("scale", torch.ones(4, 2, dtype=torch.float64), TypeError, "scale: expected torch.float32"),
    ("dtype", "float32", TypeError, "dtype: expected one of"),
    ("dtype", torch.int8, TypeError, "dtype: expected one of"),
    ("shape", (4, -256), ValueError, "shape: expected"),
    ("shape", (4, 2.5), ValueError, "shape: expected"),
    ("shape", (), ValueError, "shape: expected"),
])
def test_constructor_validates_its_fields(field, value, error, match):
    _, parts = _parts()
    parts[field] = value
    with pytest.raises(error, match=match):
        lowprec.QuantizedTensor(**parts)


@pytest.mark.parametrize("shape", [(4, 2.5), "4x256"])
def test_constructor_shape_error_shows_the_shape_given(shape):
    """A shape torch.Size cannot take is named as given, not as None."""
    _, parts = _parts()
    with pytest.raises(ValueError, match=r"shape: expected .*got " + re.escape(repr(shape))):
        lowprec.QuantizedTensor(**{**parts, "shape": shape})


def test_constructor_validates_fp4_and_global_scale():
    _, parts = _parts("nvfp4", (4, 33))
    assert parts["data"].shape == (4, 17)
    with pytest.raises(ValueError, match=r"data: expected shape \(4, 17\)"):
        lowprec.QuantizedTensor(**{**parts, "data": parts["data"][:, :16]})
    with pytest.raises(TypeError, match="data: expected torch.uint8"):
        lowprec.QuantizedTensor(**{**parts, "data": parts["data"].view(torch.int8)})
    with pytest.raises(ValueError, match="global_scale: expected a 0-dim float32"):
        lowprec.QuantizedTensor(**{**parts, "global_scale": parts["global_scale"].reshape(1)})


def test_to_refuses_dtypes():
    qt, _ = _parts()
    with pytest.raises(TypeError, match="dequantize"):
        qt.to(torch.bfloat16)
    assert qt.data.dtype == torch.float8_e4m3fn
    # no advice to dequantize to what dequantize refuses; a device in the dtype's place named as given
    with pytest.raises(TypeError, match=r"devices only, got torch.int8$"):
        qt.to(torch.int8)
    with pytest.raises(TypeError, match=r"devices only, got 'cpu'$"):
        qt.to("cpu", "cpu")


def test_to_copies_only_when_asked():
    qt, _ = _parts("nvfp4")
    same = qt.to("cpu")
    assert same.data.data_ptr() == qt.data.data_ptr()  # as torch.Tensor.to
    copy = qt.to("cpu", copy=True)
    for a, b in ((copy.data, qt.data), (copy.scale, qt.scale), (copy.global_scale, qt.global_scale)):
        assert a.data_ptr() != b.data_ptr() and torch.equal(a.float(), b.float())


def test_to_takes_torch_tensor_to_arguments_for_device_moves():
    qt, _ = _parts("nvfp4")
    for moved in (qt.to("cpu", None, True, True), qt.to(device=torch.device("cpu"), non_blocking=True, copy=True),
                  qt.to(copy=True), qt.to("cpu", memory_format=torch.preserve_format, copy=True)):
        assert moved.device == qt.device and moved.data.data_ptr() != qt.data.data_ptr()
        assert torch.equal(moved.dequantize(), qt.dequantize())
    assert qt.to("cpu", non_blocking=True).data.data_ptr() == qt.data.data_ptr()
    # the dtype is named, not taken for `copy` (torch's unrelated TypeError)
    for args, kwargs in ((("cpu", torch.float16), {}), (("cpu",), {"dtype": torch.float16}),
                         ((torch.float16, False, True), {})):
        with pytest.raises(TypeError, match=r"dtype: .*dequantize\(torch.float16\)"):
            qt.to(*args, **kwargs)
    for args, kwargs, match in (((torch.zeros(1),), {}, "tensor: .*dtype"),
                                (("cpu",), {"memory_format": torch.channels_last}, "memory_format"),
                                (("cpu", None, "yes"), {}, "non_blocking: expected a bool"),
                                (("cpu",), {"copy": 1}, "copy: expected a bool"),
                                ((1.5,), {}, "device: expected"),
                                (("cpu",), {"device": "cpu"}, "device both"),
                                (("cpu",), {"pin": True}, "unexpected keyword argument 'pin'"),
                                (("cpu", None, False, False, 0), {}, "at most 4 positional")):
        with pytest.raises(TypeError, match=match):
            qt.to(*args, **kwargs)


def test_transpose_of_a_1d_tensor_says_why():
    with pytest.raises(ValueError, match="transpose: needs ≥ 2 dims"):
        lowprec.quantize(torch.randn(64), "fp8_tensorwise").transpose()


@pytest.mark.parametrize("shape", [(0,), (0, 64), (3, 0), (2, 0, 64)])
def test_tensorwise_empty_tensors_round_trip(shape):
    x = torch.randn(shape)
    q = lowprec.quantize(x, "fp8_tensorwise")
    assert q.scale.shape == (1,) * len(shape)
    d = q.dequantize()
    assert d.shape == x.shape and d.dtype == x.dtype


def test_square_fp4_blocks_are_refused_for_the_right_reason():
    q = lowprec.quantize(torch.randn(32, 64), "nvfp4", weight_2d=True)
    assert q.recipe.block == (16, 16) and not q.transposable
    with pytest.raises(ValueError, match="not transposable") as err:
        q.transpose()
    assert "not square" not in str(err.value) and "e2m1" in str(err.value)


def test_non_square_blocks_still_refused():
    q = lowprec.quantize(torch.randn(4, 256), "fp8_block1x128")
    with pytest.raises(ValueError, match="^transpose: .*1x128"):
        q.transpose()


def _same(a: lowprec.QuantizedTensor, b: lowprec.QuantizedTensor) -> bool:
    return (a.recipe == b.recipe and a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
            and torch.equal(a.scale.float(), b.scale.float())
            and (a.global_scale is None) == (b.global_scale is None)
            and (a.global_scale is None or torch.equal(a.global_scale, b.global_scale)))


@pytest.mark.parametrize("recipe, options", [("fp8_block128x128", {"pow2_scale": True}), ("fp8_block1x128", {}),
                                             ("mxfp8", {}), ("nvfp4", {"weight_2d": True})])
def test_torch_save_and_weights_only_torch_load_round_trip(recipe, options, tmp_path):
    """torch.load's default (weights_only=True since torch 2.6) refused a pickled QuantizedTensor."""
    qt = lowprec.quantize(torch.randn(2, 64, 256, dtype=torch.bfloat16), recipe, **options)
    torch.save({"q": qt, "bias": torch.ones(3)}, tmp_path / "q.pt")
    back = torch.load(tmp_path / "q.pt")
    assert isinstance(back["q"], lowprec.QuantizedTensor) and _same(back["q"], qt)
    assert torch.equal(back["bias"], torch.ones(3))


def test_weights_only_torch_load_validates_a_pickled_quantized_tensor(tmp_path):
    from lowprec.tensor import _rebuild_quantized_tensor

    qt = lowprec.quantize(torch.randn(4, 256), "fp8_block1x128")

    class Tampered:  # the parts of qt under the metadata of a wider tensor
        def __reduce__(self):
            return _rebuild_quantized_tensor, (qt.data, qt.scale, None, {**qt.metadata(), "shape": [4, 300]})

    torch.save(Tampered(), tmp_path / "q.pt")
    with pytest.raises(ValueError, match=r"QuantizedTensor \(unpickled\): data: expected shape \(4, 300\)"):
        torch.load(tmp_path / "q.pt")


def test_weights_only_torch_load_refuses_a_pickle_that_sets_the_fields(tmp_path, monkeypatch):
    """Only the validating rebuild function is allow-listed, not the class: pickle's default form of
    the object (its fields set as they are) stays refused."""
    qt = lowprec.quantize(torch.randn(4, 256), "fp8_block1x128")
    monkeypatch.setattr(lowprec.QuantizedTensor, "__reduce__", object.__reduce__)
    torch.save(qt, tmp_path / "q.pt")
    monkeypatch.undo()
    with pytest.raises(pickle.UnpicklingError, match="QuantizedTensor"):
        torch.load(tmp_path / "q.pt")


def test_deepcopy_copies_and_copy_shares_the_tensors():
    qt = lowprec.quantize(torch.randn(32, 64), "nvfp4")
    deep, shallow = copy.deepcopy(qt), copy.copy(qt)
    assert _same(deep, qt) and deep.data.data_ptr() != qt.data.data_ptr()
    assert shallow.data is qt.data and shallow.scale is qt.scale and shallow.global_scale is qt.global_scale


def test_a_shape_of_numpy_integers_saves_and_pickles(tmp_path):
    """torch.Size keeps numpy integers: the metadata held them, which json.dumps (lowprec.save) and
    weights_only torch.load refused."""
    np = pytest.importorskip("numpy")
    qt, parts = _parts()
    qt = lowprec.QuantizedTensor(**{**parts, "shape": np.array(qt.shape)})
    assert all(type(n) is int for n in qt.metadata()["shape"])
    lowprec.save(qt, tmp_path / "q.safetensors")
    torch.save(qt, tmp_path / "q.pt")
    for back in (lowprec.load(tmp_path / "q.safetensors"), torch.load(tmp_path / "q.pt")):
        assert _same(back, qt)
