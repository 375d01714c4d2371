"""The GEMM custom op: torch.compile traces it without graph breaks; fake and real agree."""

import torch

import lowprec
from lowprec.recipes import RECIPE_NAMES, ScaleRecipe, get_recipe


def test_recipe_spec_roundtrip():
    for name in RECIPE_NAMES:
        r = get_recipe(name)
        assert ScaleRecipe.from_spec(r.spec()) == r


def test_opcheck_fake_and_dynamic():
    a = lowprec.quantize(torch.randn(47, 256), "fp8_block1x128")
    b = lowprec.quantize(torch.randn(64, 256), "nvfp4")
    args = (a.data, a.scale, None, a.recipe.spec(), b.data, b.scale, b.global_scale, b.recipe.spec(), 256,
            torch.randn(64), torch.float32)
    torch.library.opcheck(torch.ops.lowprec.gemm.default, args,
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_compile_fullgraph_matches_eager():
    def f(x, w):
        return lowprec.gemm(lowprec.quantize(x, "fp8_block1x128", check_finite=False), w, out_dtype=torch.float32)

    w = lowprec.quantize(torch.randn(64, 256), "fp8_block128x128")
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for rows in (33, 47):
        x = torch.randn(rows, 256)
        assert torch.equal(compiled(x, w), f(x, w))
