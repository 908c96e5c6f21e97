"""The coupling sampler's law: marginals p and q, P(x != y) = TV, diagonal = min(p, q)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

import kvcouple
from kvcouple.reference.kernels import couple_ref

N = 40_000
# With fixed seeds these are deterministic; 1e-4 guards against a chance failure on reseeding.
ALPHA = 1e-4


def _pairs():
    rng = np.random.default_rng(2026)
    yield "dirichlet", rng.dirichlet(np.ones(12)), rng.dirichlet(np.ones(12))
    p = rng.dirichlet(np.full(40, 0.3))
    yield "close", p, 0.9 * p + 0.1 * rng.dirichlet(np.full(40, 0.3))
    yield "sparse", np.array([0.5, 0.5, 0, 0, 0]), np.array([0, 0.25, 0.25, 0.25, 0.25])
    yield "disjoint", np.array([0.3, 0.7, 0, 0]), np.array([0, 0, 0.6, 0.4])
    yield "identical", np.array([0.1, 0.2, 0.3, 0.4]), np.array([0.1, 0.2, 0.3, 0.4])


def _chi2_pvalue(counts: np.ndarray, expected_prob: np.ndarray) -> float:
    support = expected_prob > 0
    assert counts[~support].sum() == 0, "a token outside the support was drawn"
    exp = expected_prob[support] * counts.sum()
    if support.sum() == 1:
        return 1.0
    return stats.chisquare(counts[support], exp).pvalue


@pytest.mark.parametrize(
    ("name", "p", "q"), list(_pairs()), ids=lambda x: x if isinstance(x, str) else ""
)
def test_law_of_the_coupling(name, p, q):
    vocab = len(p)
    u = np.random.default_rng(7).random((N, 3))
    x, y, diverged = kvcouple.couple(np.tile(p, (N, 1)), np.tile(q, (N, 1)), u)
    assert np.array_equal(diverged, x != y)
    assert _chi2_pvalue(np.bincount(x, minlength=vocab), p) > ALPHA
    assert _chi2_pvalue(np.bincount(y, minlength=vocab), q) > ALPHA
    tv = 0.5 * np.abs(p - q).sum()
    rate = diverged.mean()
    se = np.sqrt(max(tv * (1 - tv), 1e-12) / N)
    assert abs(rate - tv) <= 4 * se + 1e-12, (rate, tv)
    # Where they agree, the common token follows the overlap min(p, q) / (1 - tv).
    if tv < 1:
        agree = np.bincount(x[~diverged], minlength=vocab)
        assert _chi2_pvalue(agree, np.minimum(p, q) / (1 - tv)) > ALPHA
    # Where they differ, x follows (p - q)+ and y follows (q - p)+.
    if tv > 0:
        assert (
            _chi2_pvalue(np.bincount(x[diverged], minlength=vocab), np.maximum(p - q, 0) / tv)
            > ALPHA
        )
        assert (
            _chi2_pvalue(np.bincount(y[diverged], minlength=vocab), np.maximum(q - p, 0) / tv)
            > ALPHA
        )


def test_deterministic_and_thread_independent():
    rng = np.random.default_rng(11)
    p = rng.dirichlet(np.ones(5000), size=64)
    q = rng.dirichlet(np.ones(5000), size=64)
    u = rng.random((64, 3))
    first = kvcouple.couple(p, q, u)
    before = kvcouple.get_num_threads()
    try:
        kvcouple.set_num_threads(1)
        assert kvcouple.get_num_threads() == 1
        single = kvcouple.couple(p, q, u)
        d1 = kvcouple.divergences(p, q)
    finally:
        kvcouple.set_num_threads(0)
    assert kvcouple.get_num_threads() == before
    for a, b in zip(first, single):
        assert np.array_equal(a, b)
    assert np.array_equal(d1.tv, kvcouple.divergences(p, q).tv)


def test_edge_uniforms_and_degenerate_rows():
    # delta = 0 and delta = 1 with uniforms at the ends of [0, 1).
    top = np.nextafter(1.0, 0.0)
    p = np.array([[0.5, 0.5], [1.0, 0.0], [1.0, 0.0]])
    q = np.array([[0.5, 0.5], [0.0, 1.0], [1.0, 0.0]])
    for u0 in (0.0, top):
        u = np.array([[u0, top, top]] * 3)
        x, y, d = kvcouple.couple(p, q, u)
        assert list(d) == [False, True, False]
        assert list(x) == [1, 0, 0] and list(y) == [1, 1, 0]
    # vocab 1: nothing can differ.
    x, y, d = kvcouple.couple(np.ones((3, 1)), np.ones((3, 1)), np.zeros((3, 3)))
    assert not d.any() and not x.any() and not y.any()


def test_identical_rows_at_u0_zero_take_the_overlap():
    """delta = 0 for identical rows, and u0 = 0 is not below it: the overlap branch, x = y =
    the inverse CDF of p at u1, whatever u2 says (a residual draw would use u2 for y)."""
    p = np.array([0.2, 0.3, 0.5])
    u1 = np.array([0.0, 0.1, 0.25, 0.45, 0.6, 0.99])
    u = np.column_stack([np.zeros_like(u1), u1, 1.0 - u1 - 1e-9])
    rows = np.tile(p, (len(u1), 1))
    want = np.searchsorted(np.cumsum(p), u1, side="right")  # first index with cum > u1
    x, y, diverged = kvcouple.couple(rows, rows.copy(), u)
    assert not diverged.any()
    assert x.tolist() == want.tolist() and y.tolist() == want.tolist()
    ref = couple_ref(rows, rows.copy(), u)
    assert ref[:, 0].tolist() == want.tolist() and ref[:, 1].tolist() == want.tolist()
    assert not ref[:, 2].any()
