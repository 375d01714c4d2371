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
