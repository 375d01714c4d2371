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


def test_cos_sim_against_an_all_zero_tensor_is_not_perfect():
    x = torch.randn(10)
    assert metrics.cos_sim(x, torch.zeros(10)) == 0.0
    assert metrics.cos_sim(torch.zeros(10), x) == 0.0
    assert metrics.cos_sim(torch.zeros(10), torch.zeros(10)) == 1.0  # identical


def test_empty_tensors_are_identical_by_every_metric():
    e = torch.zeros(0, 4)
    assert metrics.error_report(e, e) == {"cos_sim": 1.0, "rel_l1": 0.0, "rel_l2": 0.0, "rmse": 0.0,
                                          "sqnr_db": math.inf, "calc_diff": 0.0, "max_rel_err": 0.0}


def test_cos_sim_of_fp64_vectors_past_the_norms_range():
    tiny = torch.tensor([1e-170, 2e-170], dtype=torch.float64)
    assert metrics.cos_sim(-tiny, tiny) == pytest.approx(-1.0)
    big = torch.tensor([1e200, 2e200], dtype=torch.float64)
    assert metrics.cos_sim(big, big) == pytest.approx(1.0)


@pytest.mark.parametrize("mag", [1e-170, 1e170])
def test_squared_metrics_of_fp64_tensors_past_the_squares_range(mag):
    ref = torch.tensor([1.0, 2.0], dtype=torch.float64)
    x = ref * 1.5
    plain = {name: getattr(metrics, name)(x, ref) for name in ("rel_l2", "sqnr_db", "calc_diff")}
    assert plain["rel_l2"] == pytest.approx(0.5)
    for name, want in plain.items():
        assert getattr(metrics, name)(x * mag, ref * mag) == pytest.approx(want), name
    assert metrics.rmse(x * mag, ref * mag) == pytest.approx(mag * metrics.rmse(x, ref))
    assert math.isfinite(metrics.sqnr_db(x * mag, ref * mag))


def test_squared_metrics_unchanged_for_ordinary_values():
    ref = torch.tensor([3.0, -4.0])
    x = torch.tensor([3.0, -3.0])
    assert metrics.rel_l2(x, ref) == 0.2 and metrics.rmse(x, ref) == math.sqrt(0.5)
    assert metrics.sqnr_db(x, ref) == pytest.approx(10 * math.log10(25))


@pytest.mark.parametrize("mag", [1e-310, 5e307])  # FP64 subnormals; magnitudes >= 2^1023
def test_metrics_are_scale_invariant_at_fp64_extremes(mag):
    ref = torch.tensor([1.0, 2.0], dtype=torch.float64)
    x = ref * 1.5
    for name in ("rel_l1", "rel_l2", "sqnr_db", "calc_diff", "max_rel_err"):
        f = getattr(metrics, name)
        assert f(x * mag, ref * mag) == pytest.approx(f(x, ref), rel=1e-9), name
    assert metrics.rmse(x * mag, ref * mag) == pytest.approx(mag * metrics.rmse(x, ref), rel=1e-9)


def test_rel_l1_and_max_rel_err_do_not_overflow():
    ref = torch.tensor([1e308, -1e308], dtype=torch.float64)
    assert metrics.rel_l1(-ref, ref) == pytest.approx(2.0)
    assert metrics.max_rel_err(-ref, ref) == pytest.approx(2.0)


def test_cos_sim_of_equal_tensors_is_one_at_most():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for t in (x, x * 1e-3, x.float(), torch.linspace(-1, 7, 999)):
        assert metrics.cos_sim(t, t) <= 1.0 and metrics.cos_sim(t, -t) >= -1.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_cos_sim_of_a_non_finite_tensor_is_nan(bad):
    ref = torch.tensor([1.0, -2.0, 3.0, 4.0])
    x = ref.clone()
    x[1] = bad
    zero = torch.zeros(4)
    # NaN, as every other metric of such a pair; not -1.0 ("opposite") or 0.0 ("no overlap")
    for a, b in ((x, ref), (ref, x), (x, zero), (zero, x)):
        assert math.isnan(metrics.cos_sim(a, b))


def test_sqnr_of_an_infinite_error_is_minus_inf_not_an_exception():
    ref = torch.tensor([1.0, -2.0, 3.0, 4.0])
    x = ref.clone()
    x[2] = math.inf  # e.g. an fp16 output that overflowed
    assert metrics.sqnr_db(x, ref) == -math.inf
    x[2] = math.nan
    assert math.isnan(metrics.sqnr_db(x, ref))
    x[2] = math.inf
    report = metrics.error_report(x, ref)
    assert report["sqnr_db"] == -math.inf and math.isnan(report["cos_sim"])


def test_metrics_take_bool_and_integer_tensors():
    """rel_l2 took abs() of the tensors as given, which torch has not for bool."""
    x, ref = torch.tensor([True, False, True]), torch.tensor([True, True, True])
    report = metrics.error_report(x, ref)
    assert report["rel_l2"] == pytest.approx(math.sqrt(1 / 3)) and report["rel_l1"] == pytest.approx(1 / 3)
    assert metrics.error_report(x.to(torch.int8), ref.to(torch.int8)) == report
