"""``python -m lowprec bench moe``: arguments, and its pieces on small CPU problems (the bench itself needs CUDA)."""

import argparse
import json
import math
import time

import pytest
import torch

from lowprec.__main__ import BENCHES
from lowprec.bench import moe as bench
from lowprec.moe import experts


def test_registered_and_parses():
    assert "moe" in BENCHES
    args = bench.parse_args([])
    assert args.configs == bench.CONFIGS and args.routings == ("balanced", "skewed")
    assert args.capacity_factor is None and not args.no_layer
    assert bench.parse_args(["--quick"]).configs == bench.CONFIGS[:1]
    args = bench.parse_args(["--configs", "4,256,128,2,64; 8,512,256,1,32", "--routings", "skewed",
                             "--capacity-factor", "1.25", "--zipf", "2", "--no-layer"])
    assert args.configs == [(4, 256, 128, 2, 64), (8, 512, 256, 1, 32)]
    assert args.routings == ("skewed",) and args.capacity_factor == 1.25 and args.zipf == 2.0 and args.no_layer
    assert args.sustained is None and bench.parse_args(["--sustained", "4"]).sustained == 4.0
    assert args.decode is None and bench.parse_args(["--decode", "1,32"]).decode == (1, 32)
    assert args.train is None and bench.parse_args(["--train", "256,4096"]).train == (256, 4096)


@pytest.mark.parametrize("argv, message", [
    (["--configs", "4,256,128,2"], "five positive ints"),
    (["--configs", "4,256,128,5,64"], "top-k 5 is more than E=4"),
    (["--configs", "4,250,128,2,64"], "multiples of 16"),
    (["--routings", "uniform"], "subset of balanced,skewed"),
    (["--capacity-factor", "0"], "number > 0"),
    (["--zipf", "nan"], "number > 0"),
    (["--sustained", "0"], "number > 0"),
    (["--decode", "0,8"], "token counts ≥ 1"),
    (["--decode", "1,a"], "token counts ≥ 1"),
    (["--train", "0"], "token counts ≥ 1"),
])
def test_bad_arguments_name_the_option(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    err = capsys.readouterr().err
    assert argv[0] in err and message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_needs_cuda():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--quick"])


@pytest.mark.parametrize("kind", ["balanced", "skewed"])
def test_routings_and_padding(kind):
    g = torch.Generator().manual_seed(0)
    r = bench.make_routing(512, 2, 16, kind, generator=g, device="cpu")
    assert (r.topk_ids[:, 0] != r.topk_ids[:, 1]).all()  # k distinct experts
    stats = bench.padding_stats(r)
    assert stats["routed_rows"] == 1024 and stats["padding_waste"] == 0
    tiled = sum(-(-c // 128) * 128 for c in r.counts.tolist())
    assert stats["tile_waste"] == pytest.approx(tiled / 1024 - 1)
    if kind == "skewed":  # Zipf: expert 0 the most popular
        assert r.counts[0] == r.counts.max() and r.counts[0] > 2 * r.counts[8:].float().mean()
    dropped = bench.make_routing(512, 2, 16, kind, capacity_factor=0.5, generator=g, device="cpu")
    assert bench.padding_stats(dropped)["padding_waste"] > 0


def test_bf16_baseline_is_the_unquantized_moe():
    g = torch.Generator().manual_seed(1)
    r = bench.make_routing(64, 2, 4, "skewed", capacity_factor=1.0, generator=g, device="cpu")
    x = torch.randn(64, 32, generator=g).bfloat16()
    w1 = (torch.randn(4, 48, 32, generator=g) / 6).bfloat16()
    w2 = (torch.randn(4, 32, 24, generator=g) / 5).bfloat16()
    args = (x, r.topk_weights, r.topk_ids, w1, w2)
    out = bench.bf16_experts(*args, capacity_factor=1.0)
    ref = experts(*args, recipe=None, capacity_factor=1.0)
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.02)


def test_error_rows_and_reference():
    g = torch.Generator().manual_seed(2)
    r = bench.make_routing(300, 2, 8, "skewed", generator=g, device="cpu")
    sample = bench.error_rows(r)
    nonempty = int((r.counts > 0).sum())
    assert len(sample) == min(bench.ERROR_EXPERTS, nonempty) and len({e for e, _ in sample}) == len(sample)
    ends = r.group_ends.tolist()
    for e, rows in sample:
        start = ends[e - 1] if e else 0
        assert 0 < len(rows) <= bench.ERROR_ROWS and (start <= rows).all() and (rows < ends[e]).all()
    x, w1 = torch.randn(300, 32, generator=g), torch.randn(8, 16, 32, generator=g)
    ref = bench.reference_rows(x, w1, r, sample)
    e, rows = sample[0]
    assert ref.dtype == torch.float64
    torch.testing.assert_close(ref[: len(rows)], x.double()[r.row_slots[rows] // 2] @ w1[e].double().T)


def test_cases_run_and_report_failing_peers(monkeypatch):
    def cpu_time(fn, budget_ms):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    monkeypatch.setattr(bench, "_time", cpu_time)
    monkeypatch.setattr(bench, "_time_queued", lambda fn: cpu_time(fn, 1.0))
    monkeypatch.setattr(bench, "sustained", lambda fn, seconds: {"ms": cpu_time(fn, 1.0), "calls": 1,
                                                                 "sm_clock_mhz": None, "power_w": None})
    g = torch.Generator().manual_seed(3)
    r = bench.make_routing(64, 2, 4, "balanced", capacity_factor=1.0, generator=g, device="cpu")
    x = torch.randn(64, 128, generator=g).bfloat16()
    w1 = (torch.randn(4, 64, 128, generator=g) / 11).bfloat16()
    w2 = (torch.randn(4, 128, 32, generator=g) / 6).bfloat16()
    args = argparse.Namespace(no_error=False, budget_ms=1.0, capacity_factor=1.0, sustained=0.01)
    failures = {}
    gemm = bench._gemm_case(x, w1, r, args, failures)
    assert gemm["lowprec"]["ms"] > 0 and gemm["lowprec"]["rel_err"] < 0.1  # FP8: a few percent
    assert len(gemm["lowprec"]["ms_rounds"]) == bench.GEMM_ROUNDS
    assert gemm["lowprec"]["sustained"]["tflops"] > 0 and gemm["bf16"]["sustained"]["calls"] == 1
    assert gemm["bf16"]["rel_err"] < 0.02
    if math.isnan(gemm["fp8_rowwise"]["ms"]):  # no _scaled_grouped_mm for CPU tensors: n/a, with the reason
        assert "gemm fp8_rowwise" in failures
    perm = bench._permutation_case(x, r, args, failures)
    assert all(ms > 0 for ms in perm.values())
    layer = bench._layer_case(x, w1, w2, r, args, failures)
    assert all(v > 0 for name in ("lowprec", "bf16") for v in layer[name].values()), failures
    assert {"fwd_bwd_reused_weights_ms", "fwd_fp8_weights_ms"} <= set(layer["lowprec"])
    assert all(t.grad is None for t in (x, w1, w2))  # the timed calls leave the caller's tensors alone


def test_nvidia_smi_samples_parse():
    from lowprec.bench.common import parse_smi_samples

    ramp = "345, 70.1\n" * 5
    text = ramp + "1365, 696.5\n1320, 699.0\n[N/A], 12\nnot a sample\n1410, 697.2\n"
    assert parse_smi_samples(text) == (1365.0, 697.2)  # the ramp and the unreadable lines dropped
    assert parse_smi_samples("1500, 300\n", skip=5) == (1500.0, 300.0)  # fewer than skip: all kept
    assert parse_smi_samples("") == (None, None)


def test_sustained_needs_a_positive_duration():
    from lowprec.bench.common import sustained

    with pytest.raises(ValueError, match="seconds"):
        sustained(lambda: None, 0)


def test_decode_bf16_layer_is_the_unquantized_moe_layer():
    """The decode table's bf16 baseline is the MoE module's computation with recipe None."""
    from lowprec.moe import MoE

    torch.manual_seed(3)
    moe = MoE(32, 24, 4, 2, recipe=None, dtype=torch.bfloat16)
    x = torch.randn(16, 32).bfloat16()
    with torch.no_grad():
        out = bench.bf16_layer(x, moe.router.weight, 2, moe.w1, moe.w2)
        torch.testing.assert_close(out.float(), moe(x).float(), rtol=0.02, atol=0.02)


def test_ep_bench_runs_on_cpu_processes():
    """bench moe --ep's worker on 2 gloo processes (timings meaningless here): a row per dispatch,
    the same outputs both ways, FP8 moving a bit over half of bf16's bytes."""
    from lowprec.bench import moe_ep

    rows = moe_ep.ep_rows(2, [(4, 256, 64, 2, 24)], steps=1, warmup=0, backend="gloo")
    assert [r["dispatch"] for r in rows] == ["fp8", "bf16"] and all(r["max_output_diff"] == 0 for r in rows)
    fp8, bf16 = (r["dispatch_bytes"] for r in rows)
    assert bf16 > 0 and fp8 / bf16 == (256 + 4 * 2) / (2 * 256)


def test_ep_argument():
    from lowprec.bench.moe import parse_args
    from lowprec.bench.moe_ep import EP_CONFIGS

    assert parse_args(["--ep", "2"]).configs == list(EP_CONFIGS)
    with pytest.raises(SystemExit):
        parse_args(["--ep", "1"])


def test_ep_rows_of_other_configs_merge_into_the_saved_ones(tmp_path):
    from lowprec.bench import moe_ep

    path = str(tmp_path / "r.json")
    row = dict(E=64, H=7168, F=2048, top_k=8, T_per_rank=8192, world=2, step_ms=50.0)
    full = [dict(row, dispatch="fp8"), dict(row, dispatch="bf16", step_ms=51.0)]
    moe_ep.save(full, "gpu", path)
    other = [dict(row, T_per_rank=1024, dispatch="fp8", step_ms=9.0)]
    moe_ep.save(other, "gpu", path, partial=True)
    rows = json.load(open(path))["moe_ep"]["rows"]
    assert sorted((r["T_per_rank"], r["dispatch"], r["step_ms"]) for r in rows) == [
        (1024, "fp8", 9.0), (8192, "bf16", 51.0), (8192, "fp8", 50.0)]
    moe_ep.save(other, "gpu", path)  # the default configs (a full run) replace the section
    assert json.load(open(path))["moe_ep"]["rows"] == other
