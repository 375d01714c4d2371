import json

from lowprec.bench.common import save_results


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
