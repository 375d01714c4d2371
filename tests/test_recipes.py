import pytest
import torch

import lowprec
from lowprec.recipes import RECIPE_NAMES, WHOLE, ScaleRecipe, get_recipe


def test_named_recipes():
    assert set(RECIPE_NAMES) == {"fp8_tensorwise", "fp8_rowwise", "fp8_block1x128", "fp8_block16x128",
                                 "fp8_block128x128", "mxfp8", "mxfp4", "nvfp4"}
    assert get_recipe("fp8_block1x128").block == (1, 128)
    assert get_recipe("fp8_block16x128").block == (16, 128)
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
    with pytest.raises(TypeError, match=r"unknown options \['pow2_scale'\]; its options: \['rounding'\]"):
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


@pytest.mark.parametrize("args, match", [
    (("g", (1, 16), "e4m3", "fp32", "exact", True), "global_scale.*E4M3 block scales"),
    (("g", (1, 32), "e4m3", "e8m0", "rceil", True), "global_scale.*E4M3 block scales"),
    (("g", (1, 16), "e2m1", "e4m3", "exact", False), "E4M3 block scales need.*global_scale"),
    (("g", (1, 16), "e2m1", "e4m3", "pow2", True), "E4M3 block scales.*'exact'"),
    (("g", (2.5, 16)), "block: .*integers"),
    (("g", (1, True)), "block: .*integers"),
    (("g", (1, 16, 1)), "block: .*two"),
    (("g", 16), "block: .*two"),
    (("g", (1, 16), "e3m4"), "elem_format"),
    (("g", (1, 16), "e4m3", "fp32", "exact", "yes"), "global_scale: expected a bool"),
    ((7, (1, 16)), "name"),
])
def test_invalid_combinations_are_rejected_at_construction(args, match):
    with pytest.raises(ValueError, match=match):
        ScaleRecipe(*args)


@pytest.mark.parametrize("name, option, value", [
    ("fp8_block1x128", "pow2_scale", "no"), ("fp8_tensorwise", "pow2_scale", 1), ("nvfp4", "weight_2d", "yes"),
])
def test_recipe_options_must_be_bools(name, option, value):
    with pytest.raises(TypeError, match=f"{option}: expected a bool"):
        get_recipe(name, **{option: value})


def test_named_recipe_names_are_reserved():
    # kernels are picked by name: an E5M2 recipe called "fp8_rowwise" would get E4M3 kernels
    with pytest.raises(ValueError, match="name: 'fp8_rowwise' is a named recipe"):
        ScaleRecipe("fp8_rowwise", (1, WHOLE), "e5m2")
    assert ScaleRecipe("fp8_rowwise", (1, WHOLE), "e4m3", "fp32", "pow2") == get_recipe("fp8_rowwise", pow2_scale=True)
    assert ScaleRecipe("my_rowwise", (1, WHOLE), "e5m2").elem_format == "e5m2"


def test_from_spec_reads_back_a_name_with_colons():
    """from_spec is spec()'s inverse (the compiled gemm passes recipes through it); a custom
    recipe's name may hold ':'."""
    r = ScaleRecipe("team:mx8", (1, 32), "e4m3", "e8m0", "rceil")
    assert ScaleRecipe.from_spec(r.spec()) == r
    for name in RECIPE_NAMES:
        assert ScaleRecipe.from_spec(get_recipe(name).spec()) == get_recipe(name)


@pytest.mark.parametrize("recipe", [["mxfp8"], {"name": "mxfp8"}])
def test_unhashable_recipe_names_the_argument(recipe):
    with pytest.raises(ValueError, match="^recipe: unknown recipe"):
        lowprec.get_recipe(recipe)
    with pytest.raises(ValueError, match="^recipe: unknown recipe"):
        lowprec.quantize(torch.randn(4, 32), recipe)


def test_unhashable_linear_recipe_names_the_argument():
    from lowprec.recipes import get_linear_recipe

    with pytest.raises(ValueError, match="^recipe: unknown linear recipe"):
        get_linear_recipe(["fp8_block"])
