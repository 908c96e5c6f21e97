"""The standard-library normal and Student t functions the bootstrap uses, against scipy
(a test dependency only: the analysis core must not import it)."""

import math

import numpy as np
import pytest

from kvcouple.analysis.distributions import (
    beta_inc,
    norm_cdf,
    norm_ppf,
    sorted_quantile,
    t_cdf,
    t_ppf,
)

stats = pytest.importorskip("scipy.stats")
special = pytest.importorskip("scipy.special")

Z = [-30.0, -12.5, -6.0, -2.3, -1e-3, 0.0, 0.7, 1.96, 4.0, 9.0]
DF = [1, 2, 3, 7, 15, 63, 1000]
P = [1e-300, 1e-20, 1e-6, 0.001, 0.025, 0.3, 0.5, 0.6, 0.975, 0.999, 1 - 1e-12]


def rel_close(a: float, b: float, rtol: float) -> bool:
    return a == b or abs(a - b) <= rtol * max(abs(a), abs(b))


@pytest.mark.parametrize("z", Z)
def test_norm_cdf_keeps_relative_accuracy_in_the_tail(z):
    assert rel_close(norm_cdf(z), float(stats.norm.cdf(z)), 1e-12)


@pytest.mark.parametrize("p", P)
def test_norm_ppf(p):
    assert rel_close(norm_ppf(p), float(stats.norm.ppf(p)), 1e-9)


@pytest.mark.parametrize("df", DF)
@pytest.mark.parametrize("t", [-200.0, -30.0, -4.0, -1.0, -0.01, 0.0, 0.5, 2.2, 12.0, 80.0])
def test_t_cdf(t, df):
    assert rel_close(t_cdf(t, df), float(stats.t.cdf(t, df)), 1e-10)


@pytest.mark.parametrize("df", DF)
@pytest.mark.parametrize("p", [1e-12, 1e-4, 0.025, 0.2, 0.5, 0.8, 0.975, 0.9999])
def test_t_ppf(p, df):
    assert rel_close(t_ppf(p, df), float(stats.t.ppf(p, df)), 1e-9)


@pytest.mark.parametrize("a,b", [(0.5, 0.5), (3.0, 0.5), (40.0, 2.5), (0.1, 9.0)])
@pytest.mark.parametrize("x", [1e-9, 0.01, 0.3, 0.5, 0.77, 0.999])
def test_beta_inc(a, b, x):
    assert rel_close(beta_inc(a, b, x), float(special.betainc(a, b, x)), 1e-10)


def test_edges_and_errors():
    assert t_cdf(math.inf, 3) == 1.0 and t_cdf(-math.inf, 3) == 0.0
    assert math.isnan(t_cdf(math.nan, 3))
    assert norm_ppf(0.0) == -math.inf and norm_ppf(1.0) == math.inf
    with pytest.raises(ValueError, match="df > 0"):
        t_ppf(0.5, 0)
    with pytest.raises(ValueError, match="a, b > 0"):
        beta_inc(0.0, 1.0, 0.5)


def test_sorted_quantile_is_numpys_linear_quantile_to_the_bit() -> None:
    """The band's critical value is numpy's quantile, computed without numpy.quantile (which
    imports numpy.ma on every command): equal to the bit over sizes, scales and levels."""
    rng = np.random.default_rng(7)
    for _ in range(5000):
        n = int(rng.integers(1, 60))
        values = np.sort(rng.standard_normal(n) * 10.0 ** float(rng.integers(-6, 6)))
        q = float(rng.choice([0.5, 0.9, 0.95, 0.99, float(rng.random())]))
        assert sorted_quantile(values, q) == float(np.quantile(values, q))
    # Infinite ends: the same where numpy's formula is defined, the end itself where two
    # equal infinities meet (numpy's interpolation makes NaN of inf - inf).
    with_inf = np.array([-np.inf, 1.0, 2.0, np.inf, np.inf])
    assert sorted_quantile(with_inf, 0.95) == np.inf
    assert sorted_quantile(with_inf, 0.0) == -np.inf
    assert math.isnan(sorted_quantile(np.array([]), 0.5))
