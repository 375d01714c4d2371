"""``python -m lowprec bench linear``: registration and shapes on the CPU; the per-kernel split of
the FP8 step on the GPU (a small shape; timings are the benchmark's business, not asserted)."""

import pytest
import torch

from lowprec.__main__ import BENCHES
from lowprec.bench import linear as bench
from lowprec.recipes import get_linear_recipe


def test_registered_with_the_issue_shapes():
    assert "linear" in BENCHES
    assert bench.TOKENS == 16384
    assert bench.SHAPES == [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192)]
    assert set(bench.GEMM_PARTS) <= set(bench.STEP_PARTS)


@pytest.mark.gpu
def test_step_parts_cover_every_kernel_of_the_step():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    w = torch.randn(384, 256, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    dy = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16, generator=g)
    parts = bench.step_parts_ms(x, w, dy)
    assert list(parts) == list(bench.STEP_PARTS)
    assert all(ms > 0 for ms in parts.values()), parts
    assert x.grad is None and w.grad is None  # no autograd work behind the caller's back


@pytest.mark.parametrize("shapes", ["abc", "1024x", "12", "0x128", "100x256", "256x4096,4096x100"])
def test_bad_shapes_are_usage_errors(shapes):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--shapes", shapes])
    assert exit_info.value.code == 2


def test_unknown_linear_recipe_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--recipe", "no_such_recipe"])
    assert exit_info.value.code == 2 and "--recipe" in capsys.readouterr().err


def test_known_linear_recipes_still_parse(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):  # past parsing
        bench.main(["--recipe", "fp8_block_wgrad16"])


@pytest.mark.parametrize("recipe", ["fp8_block", "fp8_block_wgrad16", "fp8_block_wgrad2d"])
def test_step_parts_use_the_recipes_wgrad_activation(monkeypatch, recipe):
    seen = {}
    real_gemm, real_dual = bench.gemm, bench.quantize_dual

    def gemm(a, b, **kw):
        seen.setdefault("gemm", []).append((a.recipe.name, b.recipe.name))
        return real_gemm(a, b, **kw)

    def quantize_dual(x, r, r_t=None):
        out = real_dual(x, r, r_t)
        seen.setdefault("dual", []).append((tuple(x.shape), out[1].recipe.name))
        return out

    monkeypatch.setattr(bench, "bench_ms", lambda fn, **kw: (fn(), 1.0)[1])
    monkeypatch.setattr(bench, "gemm", gemm)
    monkeypatch.setattr(bench, "quantize_dual", quantize_dual)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 256, dtype=torch.bfloat16, generator=g)
    w = torch.randn(128, 256, dtype=torch.bfloat16, generator=g)
    dy = torch.randn(128, 128, dtype=torch.bfloat16, generator=g)
    bench.step_parts_ms(x, w, dy, recipe)
    want = get_linear_recipe(recipe).wgrad_activation
    x_duals = [name for shape, name in seen["dual"] if shape == tuple(x.shape)]
    assert x_duals and all(name == want for name in x_duals), seen["dual"]
    wgrad = seen["gemm"][-1]  # fprop, dgrad, wgrad in STEP_PARTS order
    assert wgrad == ("fp8_block1x128", want), seen["gemm"]
