"""``python -m lowprec bench linear``: registration and shapes on the CPU; the per-kernel split of
the FP8 step on the GPU (a small shape; timings are the benchmark's business, not asserted)."""

import pytest
import torch

from lowprec.__main__ import BENCHES
from lowprec.bench import linear as bench


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


@pytest.mark.parametrize("shapes", ["abc", "1024x", "12", "0x128"])
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
