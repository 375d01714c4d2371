import math

import pytest
import torch

from lowprec import metrics


def test_metrics_known_values():
    ref = torch.tensor([1.0, -2.0, 3.0, 4.0])
    x = ref + torch.tensor([0.1, 0.1, -0.1, 0.1])
    assert metrics.rmse(x, ref) == pytest.approx(0.1)
    assert metrics.rel_l1(x, ref) == pytest.approx(0.4 / 10)
    assert metrics.sqnr_db(x, ref) == pytest.approx(10 * math.log10(30 / 0.04))
    assert metrics.max_rel_err(x, ref) == pytest.approx(0.1 / 4)
    assert metrics.cos_sim(ref, ref) == pytest.approx(1.0)
    assert metrics.cos_sim(-ref, ref) == pytest.approx(-1.0)
    assert metrics.calc_diff(ref, ref) == pytest.approx(0.0, abs=1e-15)
    assert metrics.calc_diff(2 * ref, ref) == pytest.approx(1 - 4 / 5)
    assert metrics.sqnr_db(ref, ref) == math.inf
    assert set(metrics.error_report(x, ref)) >= {"cos_sim", "rel_l1", "rmse", "sqnr_db", "calc_diff"}


def test_metrics_shape_mismatch():
    with pytest.raises(ValueError, match="shape"):
        metrics.rmse(torch.zeros(3), torch.zeros(4))
