"""``python -m lowprec bench gemm``: its shapes, arguments and timing rounds on the CPU (the
bench itself needs CUDA)."""

import subprocess
import sys

import pytest
import torch

from lowprec.__main__ import BENCHES
from lowprec.bench import gemm as bench


def test_registered_with_the_issue_shapes():
    assert "gemm" in BENCHES
    shapes = bench.default_shapes()
    assert len(shapes) == 3 * 6 + 1 and shapes[-1] == (8192, 8192, 8192)
    for m in (64, 128, 4096):
        assert [(n, k) for mm, n, k in shapes if mm == m] == bench.DSV3_NK
    args = bench.parse_args(["--shapes", "64,128,256", "--rep", "20", "--no-error"])
    assert args.shapes == "64,128,256" and args.rep == 20 and args.no_error
    assert args.rounds == bench.ROUNDS and bench.parse_args(["--rounds", "8"]).rounds == 8


def test_interleaved_rounds_alternate_who_goes_first():
    calls = []

    def timer(name, ms):
        def time(rep):
            calls.append((name, rep))
            return ms
        return time

    rounds = bench._interleaved_rounds({"lp": timer("lp", 1.0), "cb": timer("cb", 2.0)}, rep=100, rounds=4)
    assert rounds == {"lp": [1.0] * 4, "cb": [2.0] * 4}
    assert [name for name, _ in calls] == ["lp", "cb", "cb", "lp", "lp", "cb", "cb", "lp"]
    assert {rep for _, rep in calls} == {50}  # each round over half the single-round time


def test_one_library_alone_is_timed_every_round():
    rounds = bench._interleaved_rounds({"lp": lambda rep: 3.0}, rep=1, rounds=bench.ROUNDS)
    assert rounds == {"lp": [3.0] * bench.ROUNDS}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit shown without CUDA")
def test_needs_cuda_exits_1():
    proc = subprocess.run([sys.executable, "-m", "lowprec", "bench", "gemm", "--quick"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stderr


def test_usage_names_the_command(capsys):
    from lowprec.bench import gemm as bench

    with pytest.raises(SystemExit):
        bench.parse_args(["--bogus"])
    assert "usage: python -m lowprec bench gemm" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--rep", "0"], ["--rep", "-5"]])
def test_a_rep_below_one_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2 and "--rep" in capsys.readouterr().err
    assert bench.parse_args(["--rep", "20"]).rep == 20


def test_summary_worst_ratio_skips_rows_without_a_timing():
    """A row whose timing failed (NaN: graph capture failed) is left out of the worst ratio, as
    out of the geomeans, wherever it sits among the rows."""
    def row(m, ratio):
        return {"m": m, "n": 2112, "k": 7168, "ratio_vs_cublas_fp8": 1.1, "ratio_vs_cublas_fp8_rowwise": 1.1,
                "ratio_vs_cublas_fp8_eager": 1.1, "cublas_fp8_blockwise_host_us": 30.0, "lowprec_host_us": 30.0,
                "ratio_vs_best_peer": ratio, "ratio_vs_best_peer_eager": ratio}

    for rows in ([row(4096, float("nan")), row(4096, 0.97), row(4096, 1.05)],
                 [row(4096, 0.97), row(4096, float("nan")), row(4096, 1.05)]):
        summary = bench.summary_of(rows)
        assert summary["min_ratio_vs_best_peer_m_ge_4096"] == 0.97
        assert summary["min_ratio_vs_best_peer_eager_m_ge_4096"] == 0.97
