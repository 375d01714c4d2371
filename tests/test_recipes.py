import pytest

from lowprec.recipes import RECIPE_NAMES, WHOLE, ScaleRecipe, get_recipe


def test_named_recipes():
    assert set(RECIPE_NAMES) == {"fp8_tensorwise", "fp8_rowwise", "fp8_block1x128", "fp8_block128x128",
                                 "mxfp8", "mxfp4", "nvfp4"}
    assert get_recipe("fp8_block1x128").block == (1, 128)
    assert get_recipe("fp8_block128x128").block == (128, 128)
    assert get_recipe("fp8_tensorwise").tensorwise
    assert get_recipe("fp8_rowwise").block == (1, WHOLE)
    mx = get_recipe("mxfp8")
    assert (mx.block, mx.scale_format, mx.scale_rounding) == ((1, 32), "e8m0", "rceil")
    assert get_recipe("mxfp4", rounding="floor").scale_rounding == "floor"
    nv = get_recipe("nvfp4")
    assert (nv.block, nv.elem_format, nv.scale_format, nv.global_scale) == ((1, 16), "e2m1", "e4m3", True)
    assert get_recipe("nvfp4", weight_2d=True).block == (16, 16)
    assert get_recipe("fp8_block1x128", pow2_scale=True).scale_rounding == "pow2"


def test_json_roundtrip():
    for name in RECIPE_NAMES:
        r = get_recipe(name)
        assert ScaleRecipe.from_json(r.to_json()) == r


def test_errors():
    with pytest.raises(ValueError, match="unknown recipe"):
        get_recipe("fp8_block1x64")
    with pytest.raises(TypeError, match="bad options"):
        get_recipe("mxfp8", pow2_scale=True)
    with pytest.raises(ValueError, match="rounding"):
        get_recipe("mxfp8", rounding="nearest")
    with pytest.raises(TypeError, match="named recipes"):
        get_recipe(get_recipe("mxfp8"), rounding="floor")
    with pytest.raises(ValueError, match="E8M0"):
        ScaleRecipe("x", (1, 32), "e4m3", "e8m0", "exact")
    with pytest.raises(ValueError, match="block"):
        ScaleRecipe("x", (WHOLE, 32))
    with pytest.raises(ValueError, match="cannot read"):
        ScaleRecipe.from_json('{"name": "x", "block": [1, 32], "elem_format": "e9m9"}')


def test_default_recipes_are_built_once_and_options_still_apply():
    assert get_recipe("fp8_block1x128") is get_recipe("fp8_block1x128")
    assert get_recipe("mxfp8", rounding="floor") != get_recipe("mxfp8")
