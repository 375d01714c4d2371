"""``python -m lowprec bench attention``: shapes, FLOP counts, arguments on the CPU (the bench needs CUDA)."""

import subprocess
import sys

import pytest
import torch

from lowprec.__main__ import BENCHES
from lowprec.bench import attention as bench


def test_registered_with_the_issue_shapes():
    assert "attention" in BENCHES
    by_name = {s.name: s for s in bench.SHAPES}
    assert by_name["d128"] == bench.Shape("d128", 4, 32, 32, 4096, 4096, 128, False)
    assert by_name["gqa-causal"].hkv == 8 and by_name["gqa-causal"].causal
    assert (by_name["d256"].h, by_name["d256"].d) == (16, 256)
    assert (by_name["s16k-causal"].b, by_name["s16k-causal"].sq) == (1, 16384)
    assert (by_name["b16-s1k-causal"].b, by_name["b16-s1k-causal"].sq) == (16, 1024)
    dec = by_name["decode"]
    assert (dec.b, dec.h, dec.hkv, dec.sq, dec.sk) == (64, 32, 8, 1, 8192)


def test_flops_count_causal_half():
    full = bench.Shape("x", 2, 4, 4, 128, 256, 64, False)
    assert full.flops == 4 * 2 * 4 * 128 * 256 * 64
    assert bench.Shape("x", 2, 4, 4, 128, 256, 64, True).flops == full.flops / 2


def test_shape_selection():
    assert [s.name for s in bench.select_shapes(bench.parse_args(["--quick"]))] == list(bench.QUICK)
    assert [s.name for s in bench.select_shapes(bench.parse_args(["--only", "d64,decode"]))] == ["d64", "decode"]
    with pytest.raises(SystemExit, match="unknown shapes"):
        bench.select_shapes(bench.parse_args(["--only", "d96"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a GPU")
def test_exits_1_without_a_gpu():
    res = subprocess.run([sys.executable, "-m", "lowprec", "bench", "attention"], capture_output=True, text=True)
    assert res.returncode == 1 and "needs a CUDA GPU" in res.stderr


def test_fp8_rows_are_never_the_emulation(monkeypatch):
    monkeypatch.setenv("LOWPREC_BACKEND", "reference")
    assert "reference" in bench.fp8_kernel_status()
    assert bench.parse_args(["--no-fp8"]).no_fp8
