"""The TV-only kernel (kvcouple.total_variation) against the full divergence kernel."""

from __future__ import annotations

import numpy as np
import pytest

import kvcouple


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_total_variation_equals_the_divergences_tv(dtype):
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(3001, 0.05), size=7)
    q = 0.6 * p + 0.4 * rng.dirichlet(np.full(3001, 0.05), size=7)
    p, q = p.astype(dtype), q.astype(dtype)
    tv = kvcouple.total_variation(p, q)
    ref = 0.5 * np.abs(p.astype(np.float64) - q.astype(np.float64)).sum(1)
    tol = 1e-6 if dtype == np.float16 else 1e-12
    np.testing.assert_allclose(tv, ref, rtol=tol, atol=tol)
    if dtype != np.float16:  # the full kernel validates rows sum to 1; f16 rows do not exactly
        np.testing.assert_allclose(tv, kvcouple.divergences(p, q).tv, rtol=1e-9, atol=1e-12)


def test_unrecorded_rows_are_nan():
    p = np.full((2, 4), 0.25)
    q = np.array([[0.5, 0.5, 0, 0], [np.nan] * 4])
    tv = kvcouple.total_variation(p, q)
    assert tv[0] == pytest.approx(0.5) and np.isnan(tv[1])
