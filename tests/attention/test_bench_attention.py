"""``python -m lowprec bench attention``: shapes, FLOP counts, arguments on the CPU (the bench needs CUDA)."""

import json
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


def test_rows_carry_both_timing_modes_and_their_own_ratios(monkeypatch):
    """Each timed row has the synced and the queued time; each mode's ratio is over that mode's
    fastest bf16 peer (a peer that wins one mode need not win the other); missing peers stay
    notes."""
    times = {("fp8", False): 1.0, ("fp8", True): 0.5, ("cudnn", False): 2.0, ("cudnn", True): 0.4}
    fns = {"lowprec-fp8+quant": lambda: torch.zeros(1), "cudnn-sdpa-bf16": lambda: torch.ones(1)}
    monkeypatch.setattr(bench, "_inputs", lambda s: (None, None, None))
    monkeypatch.setattr(bench, "_peers", lambda s, q, k, v, reason: {**fns, "fa4-bf16": "missing: no flash_attn"})
    monkeypatch.setattr(bench, "bench_ms", lambda fn, warmup, rep, queued=False, before=None: times[
        ("fp8" if fn is fns["lowprec-fp8+quant"] else "cudnn", queued)])
    args = bench.parse_args(["--no-accuracy", "--rep", "3"])
    rows = {r["impl"]: r for r in bench.run_shape(bench.Shape("x", 1, 2, 2, 128, 128, 64, False), args, None)}
    fp8, cudnn = rows["lowprec-fp8+quant"], rows["cudnn-sdpa-bf16"]
    assert (fp8["ms"], fp8["ms_queued"], cudnn["ms"], cudnn["ms_queued"]) == (1.0, 0.5, 2.0, 0.4)
    assert fp8["x_best_bf16"] == pytest.approx(2.0) and fp8["x_best_bf16_queued"] == pytest.approx(0.8)
    assert cudnn["x_best_bf16"] == pytest.approx(1.0) and cudnn["x_best_bf16_queued"] == pytest.approx(1.0)
    assert "tflops" not in rows["fa4-bf16"] and rows["fa4-bf16"]["note"].startswith("missing")


def test_rounds_interleave_the_peers_and_report_their_median(monkeypatch):
    """Each round times every peer (synced, then queued) before the next round starts; a row's time
    is the median of its rounds, so one slow round (a phase of slow host launches) does not move
    it; the rounds themselves are kept in the row."""
    calls = []
    slow = {("a", False, 0): 9.0}  # peer a's first synced round ran in a slow phase

    def fake_bench_ms(fn, warmup, rep, queued=False, before=None):
        name = fn()
        nth = sum(1 for c in calls if c == (name, queued))
        calls.append((name, queued))
        assert rep == 2  # --rep 5 over 3 rounds: ceil(5 / 3) runs a round
        return slow.get((name, queued, nth), 1.0 if name == "a" else 2.0)

    fns = {"lowprec-fp8+quant": lambda: "a", "cudnn-sdpa-bf16": lambda: "b"}
    monkeypatch.setattr(bench, "_inputs", lambda s: (None, None, None))
    monkeypatch.setattr(bench, "_peers", lambda s, q, k, v, reason: fns)
    monkeypatch.setattr(bench, "bench_ms", fake_bench_ms)
    args = bench.parse_args(["--no-accuracy", "--rep", "5", "--rounds", "3"])
    rows = {r["impl"]: r for r in bench.run_shape(bench.Shape("x", 1, 2, 2, 128, 128, 64, False), args, None)}
    assert calls == [("a", False), ("a", True), ("b", False), ("b", True)] * 3
    a = rows["lowprec-fp8+quant"]
    assert a["ms"] == 1.0 and a["ms_rounds"] == [9.0, 1.0, 1.0] and a["ms_queued_rounds"] == [1.0] * 3
    assert a["x_best_bf16"] == pytest.approx(2.0)


def test_a_peer_failing_when_timed_becomes_a_note(monkeypatch):
    def fake_bench_ms(fn, warmup, rep, queued=False, before=None):
        if fn() == "b":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return 1.0

    monkeypatch.setattr(bench, "_inputs", lambda s: (None, None, None))
    monkeypatch.setattr(bench, "_peers", lambda s, q, k, v, reason: {"lowprec-fp8+quant": lambda: "a",
                                                                     "cudnn-sdpa-bf16": lambda: "b"})
    monkeypatch.setattr(bench, "bench_ms", fake_bench_ms)
    rows = {r["impl"]: r for r in bench.run_shape(bench.Shape("x", 1, 2, 2, 128, 128, 64, False),
                                                  bench.parse_args(["--no-accuracy"]), None)}
    assert rows["cudnn-sdpa-bf16"]["note"].startswith("error: OutOfMemoryError") and "ms" not in rows["cudnn-sdpa-bf16"]
    assert rows["lowprec-fp8+quant"]["ms"] == 1.0 and "x_best_bf16" not in rows["lowprec-fp8+quant"]


def _one_fake_row(s, args, fp8_reason, before=None):
    return [{"shape": s.name, "impl": "fa4-bf16", "ms": 1.0}]


def test_quick_run_keeps_the_other_shapes(tmp_path, monkeypatch):
    path = str(tmp_path / "gpu.json")
    full = {"rows": [{"shape": s.name, "impl": "fa4-bf16", "ms": 9.0} for s in bench.SHAPES], "note": "full run"}
    json.dump({"attention": full, "gemm": {"rows": []}}, open(path, "w"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FAKE GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "gpu_slug", lambda: "fake-gpu")
    monkeypatch.setattr(bench, "fp8_kernel_status", lambda: "no kernel (test)")
    monkeypatch.setattr(bench, "run_shape", _one_fake_row)
    bench.main(["--quick", "--out", path])
    saved = json.load(open(path))
    rows = {r["shape"]: r["ms"] for r in saved["attention"]["rows"]}
    assert set(rows) == {s.name for s in bench.SHAPES}
    assert all(rows[name] == 1.0 for name in bench.QUICK)
    assert all(rows[s.name] == 9.0 for s in bench.SHAPES if s.name not in bench.QUICK)
    assert saved["gemm"] == {"rows": []}


def test_after_gemm_runs_a_gemm_before_each_run_into_its_own_section(tmp_path, monkeypatch):
    """``--after-gemm``: every timed run follows a bf16 GEMM (the chip at its power cap); its rows go
    to ``attention_after_gemm``, leaving the flushed runs' section as it was."""
    monkeypatch.setattr(bench, "GEMM_BEFORE", 16)
    assert bench.timing_setup(bench.parse_args([]))[:2] == (None, "attention")
    before, section, preceded = bench.timing_setup(bench.parse_args(["--after-gemm"]), device="cpu")
    assert section == "attention_after_gemm" and "GEMM" in preceded
    assert before().shape == (16, 16) and before().dtype == torch.bfloat16

    path = str(tmp_path / "gpu.json")
    json.dump({"attention": {"rows": [{"shape": "d128", "ms": 9.0}]}}, open(path, "w"))
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FAKE GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "fp8_kernel_status", lambda: "no kernel (test)")
    monkeypatch.setattr(bench, "timing_setup", lambda args, setup=bench.timing_setup: setup(args, device="cpu"))
    monkeypatch.setattr(bench, "run_shape", lambda s, args, reason, before=None: seen.append(before) or
                        [{"shape": s.name, "impl": "fa4-bf16", "ms": 1.0}])
    bench.main(["--only", "d128", "--after-gemm", "--out", path])
    saved = json.load(open(path))
    assert saved["attention"] == {"rows": [{"shape": "d128", "ms": 9.0}]}
    assert saved["attention_after_gemm"]["rows"] == [{"shape": "d128", "impl": "fa4-bf16", "ms": 1.0}]
    assert "GEMM" in saved["attention_after_gemm"]["timing"] and callable(seen[0])
