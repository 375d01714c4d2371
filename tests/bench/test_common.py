import json

import pytest

from lowprec.bench import attention, decode, gemm, linear, moe, train
from lowprec.bench.common import print_table, save_results


def test_save_results_merges_rows_of_a_partial_run(tmp_path):
    path = str(tmp_path / "gpu.json")
    save_results("attention", {"note": "full run", "rows": [{"shape": "a", "ms": 1.0}, {"shape": "b", "ms": 2.0}]},
                 path)
    save_results("other", {"rows": []}, path)
    save_results("attention", {"rows": [{"shape": "b", "ms": 3.0}, {"shape": "c", "ms": 4.0}]}, path,
                 merge_rows_by="shape")
    data = json.load(open(path))
    assert data["attention"]["rows"] == [{"shape": "a", "ms": 1.0}, {"shape": "b", "ms": 3.0},
                                         {"shape": "c", "ms": 4.0}]
    assert data["attention"]["note"] == "full run"
    assert data["other"] == {"rows": []}


def test_save_results_replaces_a_full_run(tmp_path):
    path = str(tmp_path / "gpu.json")
    save_results("attention", {"note": "old", "rows": [{"shape": "a"}]}, path)
    save_results("attention", {"rows": [{"shape": "b"}]}, path)
    assert json.load(open(path))["attention"] == {"rows": [{"shape": "b"}]}

@pytest.mark.parametrize("parse, argv", [
    (gemm.parse_args, ["--shapes", "64,128"]),
    (gemm.parse_args, ["--shapes", "a,b,c"]),
    (gemm.parse_args, ["--shapes", "64,128,256;"]),
    (gemm.parse_args, ["--rounds", "0"]),
    (attention.parse_args, ["--rep", "0"]),
    (decode.parse_args, ["--ms", "-1"]),
    (decode.parse_args, ["--batches", "0"]),
    (linear.main, ["--tokens", "0"]),
    (train.parse_args, ["--steps", "0"]),
    (train.parse_args, ["--train-steps", "-1"]),
    (moe.parse_args, ["--configs", ";"]),
])
def test_bad_bench_counts_and_shapes_are_usage_errors(parse, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2 and argv[0] in capsys.readouterr().err


def test_good_gemm_shapes_still_parse():
    assert gemm.parse_args(["--shapes", "64,128,256;128,256,512"]).shapes == "64,128,256;128,256,512"


def test_print_table_without_rows(capsys):
    print_table(["config", "ms"], [])
    assert capsys.readouterr().out.split() == ["config", "ms"]


@pytest.mark.parametrize("argv", [["--decode", "1", "--train", "256"], ["--ep", "2", "--decode", "1"]])
def test_moe_modes_are_exclusive(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        moe.parse_args(argv)
    assert exit_info.value.code == 2 and "pick one" in capsys.readouterr().err


def _gemm_row(m, n, k, ratio):
    return {"m": m, "n": n, "k": k, "ratio_vs_cublas_fp8": ratio, "ratio_vs_cublas_fp8_rowwise": ratio,
            "ratio_vs_cublas_fp8_eager": ratio, "cublas_fp8_blockwise_host_us": 1.0, "lowprec_host_us": 1.0,
            "ratio_vs_best_peer": ratio, "ratio_vs_best_peer_eager": ratio}


def test_save_results_merges_by_several_keys_and_list_values(tmp_path):
    path = str(tmp_path / "gpu.json")
    save_results("linear_sizes", {"rows": [{"shape": [8, 16, 16], "ms": 1.0}, {"shape": [8, 32, 32], "ms": 2.0}]},
                 path)
    # the saved shape reads back as a list: it must still match (and hash)
    save_results("linear_sizes", {"rows": [{"shape": [8, 32, 32], "ms": 3.0}]}, path, merge_rows_by="shape")
    assert json.load(open(path))["linear_sizes"]["rows"] == [{"shape": [8, 16, 16], "ms": 1.0},
                                                             {"shape": [8, 32, 32], "ms": 3.0}]
    save_results("s", {"rows": [{"m": 1, "n": 2, "ms": 1.0}, {"m": 1, "n": 3, "ms": 1.0}], "steps": [{"b": 1}]}, path)
    save_results("s", {"rows": [{"m": 1, "n": 3, "ms": 2.0}], "steps": []}, path,
                 merge_rows_by={"rows": ("m", "n"), "steps": "b"})
    assert json.load(open(path))["s"] == {"rows": [{"m": 1, "n": 2, "ms": 1.0}, {"m": 1, "n": 3, "ms": 2.0}],
                                          "steps": [{"b": 1}]}


def test_gemm_partial_run_keeps_the_other_shapes_and_resummarizes(tmp_path):
    path = str(tmp_path / "gpu.json")
    full = [_gemm_row(64, 2112, 7168, 2.0), _gemm_row(4096, 2112, 7168, 1.0)]
    gemm.save({"rows": full, "summary": gemm.summary_of(full), "note": "full run"}, path)
    quick = [_gemm_row(64, 2112, 7168, 8.0)]
    gemm.save({"rows": quick, "summary": gemm.summary_of(quick)}, path, partial=True)
    saved = json.load(open(path))["gemm"]
    assert [(r["m"], r["ratio_vs_cublas_fp8"]) for r in saved["rows"]] == [(4096, 1.0), (64, 8.0)]
    assert saved["summary"]["geomean_ratio_m4096"] == pytest.approx(1.0)
    assert saved["summary"]["geomean_ratio_m_le_128"] == pytest.approx(8.0)
    assert saved["note"] == "full run"
    gemm.save({"rows": quick, "summary": gemm.summary_of(quick)}, path)  # a full run replaces
    assert len(json.load(open(path))["gemm"]["rows"]) == 1


def test_decode_partial_runs(tmp_path):
    assert not decode.is_partial(decode.parse_args([]))
    for argv in (["--batches", ""], ["--ms", "1"], ["--shapes", "4096x4096"], ["--impls", "bf16"],
                 ["--model-modes", "compiled"]):
        assert decode.is_partial(decode.parse_args(argv)), argv
    path = str(tmp_path / "gpu.json")

    def row(impl, m, us):
        return {"n": 4096, "k": 4096, "m": m, "impl": impl, "graph_us": us}

    rows = [row("bf16", 1, 10.0), row("lowprec-nvfp4", 1, 5.0), row("bf16", 4, 10.0), row("lowprec-nvfp4", 4, 5.0)]
    steps = [{"impl": "bf16", "batch": 1, "mode": "compiled", "step_ms": 1.0}]
    decode.save({"rows": rows, "summary": decode.ratio_summary(rows), "model_step": steps}, path)
    new = [row("bf16", 1, 10.0), row("lowprec-nvfp4", 1, 2.0)]  # --ms 1 --batches ""
    decode.save({"rows": new, "summary": decode.ratio_summary(new), "model_step": []}, path, partial=True)
    saved = json.load(open(path))["decode"]
    assert saved["model_step"] == steps and len(saved["rows"]) == 4
    assert [r["graph_us"] for r in saved["rows"] if r["impl"] == "lowprec-nvfp4" and r["m"] == 1] == [2.0]
    assert saved["summary"]["lowprec-nvfp4"]["graph_us"]["cells"] == 2


def test_linear_shapes_run_merges_into_linear_sizes(tmp_path):
    path = str(tmp_path / "gpu.json")
    linear.save({"recipe": "fp8_block", "rows": [{"shape": [8192, 512, 512]}, {"shape": [8192, 1024, 1024]}]},
                path, sizes=True)
    linear.save({"recipe": "fp8_block", "rows": [{"shape": [8192, 1024, 1024], "new": True}]}, path, sizes=True)
    assert json.load(open(path))["linear_sizes"]["rows"] == [{"shape": [8192, 512, 512]},
                                                             {"shape": [8192, 1024, 1024], "new": True}]
    # another recipe's rows do not mix under the section's one recipe
    linear.save({"recipe": "fp8_rowwise", "rows": [{"shape": [8192, 512, 512]}]}, path, sizes=True)
    assert json.load(open(path))["linear_sizes"] == {"recipe": "fp8_rowwise", "rows": [{"shape": [8192, 512, 512]}]}


def test_moe_partial_runs_merge_rows_of_the_same_settings(tmp_path):
    path = str(tmp_path / "gpu.json")

    def row(e, routing, ms):
        return {"E": e, "H": 16, "F": 16, "top_k": 2, "T": 64, "routing": routing, "ms": ms}

    settings = {"capacity_factor": None, "zipf": 1.2, "tile_m": 128, "sustained_s": None}
    moe.save("moe", {**settings, "rows": [row(8, "balanced", 1.0), row(64, "balanced", 2.0)]}, path)
    moe.save("moe", {**settings, "rows": [row(8, "balanced", 3.0)]}, path, partial=True)  # --quick
    assert [r["ms"] for r in json.load(open(path))["moe"]["rows"]] == [2.0, 3.0]
    moe.save("moe", {**settings, "zipf": 2.0, "rows": [row(8, "balanced", 4.0)]}, path, partial=True)
    assert [r["ms"] for r in json.load(open(path))["moe"]["rows"]] == [4.0]  # other settings: replaced
    moe.save("moe_decode", {"rows": [{**row(8, None, 1.0), "T": 1}]}, path, partial=True)
    moe.save("moe_decode", {"rows": [{**row(8, None, 1.0), "T": 256}]}, path, partial=True)
    assert [r["T"] for r in json.load(open(path))["moe_decode"]["rows"]] == [1, 256]
