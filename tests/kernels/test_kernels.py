"""Rust divergences and coupling against the independent numba reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvcouple
from kvcouple.reference.kernels import DIVERGENCE_FIELDS, couple_ref, divergences_ref, widen

# Both sides accumulate in float64 from the same widened values; the remaining differences come
# from summation order and the vectorised logarithm (< 4e-16 relative per term).
ATOL = 1e-11
RTOL = 1e-10


def assert_divergences_match(p, q, dtype=None):
    got = kvcouple.divergences(p, q, dtype=dtype)
    want = divergences_ref(widen(p, dtype), widen(q, dtype))
    for i, name in enumerate(DIVERGENCE_FIELDS):
        g = np.asarray(getattr(got, name), dtype=np.float64)
        w = want[:, i]
        both_inf = np.isinf(g) & np.isinf(w)
        assert np.array_equal(np.isinf(g), np.isinf(w)), name
        np.testing.assert_allclose(g[~both_inf], w[~both_inf], atol=ATOL, rtol=RTOL, err_msg=name)


@st.composite
def row_pairs(draw):
    """Random and adversarial row pairs, as float64 probabilities."""
    vocab = draw(st.sampled_from([1, 2, 3, 7, 8, 9, 64, 1023, 1025, 3000]))
    rows = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**32 - 1))
    kind = draw(
        st.sampled_from(
            ["dirichlet", "sparse", "one_hot", "identical", "disjoint", "peaked", "tiny", "ties"]
        )
    )
    rng = np.random.default_rng(seed)
    alpha = draw(st.sampled_from([0.01, 0.1, 1.0, 10.0]))
    p = rng.dirichlet(np.full(vocab, alpha), size=rows)
    q = rng.dirichlet(np.full(vocab, alpha), size=rows)
    if kind == "sparse":
        p *= rng.random(p.shape) < 0.3
        q *= rng.random(q.shape) < 0.3
        p[:, 0] += 1e-3
        q[:, -1] += 1e-3
    elif kind == "one_hot":
        p = np.eye(vocab)[rng.integers(0, vocab, rows)]
        q = np.eye(vocab)[rng.integers(0, vocab, rows)]
    elif kind == "identical":
        q = p.copy()
    elif kind == "disjoint" and vocab >= 2:
        half = vocab // 2
        p[:, half:] = 0
        q[:, :half] = 0
        p[:, 0] += 1e-9
        q[:, -1] += 1e-9
    elif kind == "peaked":
        p[:, 0] += 1e6
        q[:, 0] += 1e6
    elif kind == "ties":
        # Small integer weights: maxima repeat, so top1_agree depends on which maximal index
        # counts (the first). Equal integers stay equal after dividing by the row sum.
        p = rng.integers(0, 3, size=(rows, vocab)).astype(np.float64)
        q = rng.integers(0, 3, size=(rows, vocab)).astype(np.float64)
        p[:, 0] += p.sum(axis=1) == 0
        q[:, -1] += q.sum(axis=1) == 0
    elif kind == "tiny":
        p += 1e-300
        q *= rng.random(q.shape) < 0.5
        q[:, 0] += 1e-12
    p /= p.sum(axis=1, keepdims=True)
    q /= q.sum(axis=1, keepdims=True)
    return p, q


@given(row_pairs())
def test_divergences_match_reference_float64(pair):
    assert_divergences_match(*pair)


@given(row_pairs(), st.sampled_from(["float16", "float32", "bfloat16"]))
def test_divergences_match_reference_narrow_dtypes(pair, dtype):
    p, q = pair
    if dtype == "bfloat16":
        to_bits = lambda a: (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731
        p, q = to_bits(p), to_bits(q)
    else:
        p, q = p.astype(dtype), q.astype(dtype)
    # Narrow formats round rows away from sum 1; compare on the stored values as they are.
    got = kvcouple.divergences(p, q, dtype=dtype, renormalize=False, atol=0.05)
    want = divergences_ref(widen(p, dtype), widen(q, dtype))
    np.testing.assert_allclose(got.tv, want[:, 0], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(got.entropy_p, want[:, 5], atol=ATOL, rtol=RTOL)


def test_subnormal_float16_values():
    vocab = 4096
    p = np.full((2, vocab), np.float16(2.0**-24))  # smallest subnormal
    p[:, 0] = np.float16(1.0) - np.float16(vocab * 2.0**-24)
    q = np.zeros((2, vocab), np.float16)
    q[:, 0] = 1.0
    assert_divergences_match(p, q, "float16")
    d = kvcouple.divergences(p, q)
    assert np.all(np.isinf(d.kl_pq)) and np.all(np.isfinite(d.kl_qp))


def test_large_vocab_rows():
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.full(128_256, 0.05), size=3)
    q = 0.9 * p + 0.1 * rng.dirichlet(np.full(128_256, 0.05), size=3)
    assert_divergences_match(p.astype(np.float32), q.astype(np.float32))
    assert_divergences_match(p, q)


def test_known_values():
    d = kvcouple.divergences(np.array([[1.0, 0.0]]), np.array([[0.0, 1.0]]))
    assert d.tv[0] == 1.0 and d.overlap[0] == 0.0 and np.isinf(d.kl_pq[0])
    assert d.js[0] == pytest.approx(np.log(2), abs=1e-15)
    assert d.hellinger[0] == pytest.approx(1.0)
    assert not d.top1_agree[0]
    d = kvcouple.divergences(np.array([[0.25] * 4]), np.array([[0.25] * 4]))
    assert d.tv[0] == 0.0 and d.kl_pq[0] == 0.0 and d.top1_agree[0]
    assert d.entropy_p[0] == pytest.approx(np.log(4), abs=1e-15)


# (p, q, top1_agree) with ties at the maximum: argmaxes are first-index, as in the numba reference.
TIES = [
    ([0.5, 0.5, 0.0], [0.6, 0.4, 0.0], True),
    ([0.6, 0.4, 0.0], [0.5, 0.5, 0.0], True),
    ([0.5, 0.5, 0.0], [0.4, 0.6, 0.0], False),
    ([0.0, 0.5, 0.5], [0.0, 0.4, 0.6], False),
    ([0.5, 0.5, 0.0], [0.5, 0.0, 0.5], True),
    ([0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.5, 0.0], False),
    ([0.25, 0.25, 0.25, 0.25], [0.5, 0.25, 0.25, 0.0], True),
]


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_top1_ties_take_the_first_index(dtype):
    p = np.array([c[0] + [0.0] * (4 - len(c[0])) for c in TIES])
    q = np.array([c[1] + [0.0] * (4 - len(c[1])) for c in TIES])
    want = [c[2] for c in TIES]
    if dtype == "bfloat16":  # every value above is exact in bfloat16
        bits = lambda a: (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731
        got = kvcouple.divergences(bits(p), bits(q), dtype="bfloat16")
    else:
        got = kvcouple.divergences(p.astype(dtype), q.astype(dtype))
    assert got.top1_agree.tolist() == want
    assert (divergences_ref(p, q)[:, 8] == 1.0).tolist() == want
    # Logits with tied maxima go through the same argmax after the decoding transform.
    with np.errstate(divide="ignore"):
        lp, lq = np.log(p), np.log(q)
    assert kvcouple.divergences(lp, lq, logits=True).top1_agree.tolist() == want


def _transform_ref(logits, temperature=1.0, top_k=None, top_p=None):
    """numpy restatement of the decoding transform of rust/core/src/transform.rs."""
    z = logits.astype(np.float64) / temperature
    if top_k is not None and top_k < z.shape[-1]:
        kth = np.sort(z, axis=-1)[:, -top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    pr = np.exp(z - z.max(axis=-1, keepdims=True))
    pr /= pr.sum(axis=-1, keepdims=True)
    if top_p is not None and top_p < 1:
        for r in range(pr.shape[0]):
            order = np.argsort(-pr[r], kind="stable")
            before = np.cumsum(pr[r][order]) - pr[r][order]
            pr[r][order[before >= top_p]] = 0
            pr[r] /= pr[r].sum()
    return pr


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, None, None), (0.7, None, None), (1.0, 5, None), (1.3, None, 0.9), (0.8, 20, 0.7)],
)
def test_logits_mode_applies_the_decoding_transform(temperature, top_k, top_p):
    rng = np.random.default_rng(3)
    lp = rng.normal(size=(5, 200)) * 3
    lq = lp + rng.normal(size=(5, 200)) * 0.5
    got = kvcouple.divergences(
        lp, lq, logits=True, temperature=temperature, top_k=top_k, top_p=top_p
    )
    pp = _transform_ref(lp, temperature, top_k, top_p)
    pq = _transform_ref(lq, temperature, top_k, top_p)
    want = divergences_ref(pp, pq)
    np.testing.assert_allclose(got.tv, want[:, 0], atol=1e-10)
    np.testing.assert_allclose(got.entropy_q, want[:, 6], atol=1e-10)
    assert np.array_equal(np.isinf(got.kl_pq), np.isinf(want[:, 1]))


def test_renormalize():
    p = np.array([[2.0, 2.0], [1.0, 3.0]])
    q = np.array([[1.0, 3.0], [1.0, 1.0]])
    with pytest.raises(kvcouple.InvalidInputError, match="row 0: p sums to 4"):
        kvcouple.divergences(p, q)
    d = kvcouple.divergences(p, q, renormalize=True)
    np.testing.assert_allclose(d.tv, [0.25, 0.25])


@given(row_pairs(), st.integers(0, 2**32 - 1))
def test_couple_matches_reference(pair, seed):
    p, q = pair
    u = np.random.default_rng(seed).random((p.shape[0], 3))
    x, y, diverged = kvcouple.couple(p, q, u)
    ref = couple_ref(p, q, u)
    assert np.array_equal(x, ref[:, 0]) and np.array_equal(y, ref[:, 1])
    assert np.array_equal(diverged, ref[:, 2].astype(bool))
    assert np.all((x >= 0) & (x < p.shape[1]) & (y >= 0) & (y < p.shape[1]))
    # Tokens are always inside their own support.
    assert np.all(p[np.arange(len(x)), x] > 0) and np.all(q[np.arange(len(y)), y] > 0)
    tv = kvcouple.divergences(p, q).tv
    assert not np.any(diverged & (tv == 0))


def test_results_do_not_depend_on_the_cpu_path():
    """The AVX-512, AVX2 and generic kernels sum in the same lane order: identical bits."""
    import os
    import subprocess
    import sys

    code = (
        "import numpy as np, kvcouple;"
        "r = np.random.default_rng(5); p = r.dirichlet(np.ones(3000), 4); q = r.dirichlet(np.ones(3000), 4);"
        "d = kvcouple.divergences(p, q);"
        "print(repr([float(v) for f in ('tv', 'kl_pq', 'js', 'hellinger', 'entropy_q') for v in getattr(d, f)]))"
    )
    outs = []
    for env in ({}, {"KVCOUPLE_NO_AVX512": "1"}):
        run = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
        )
        outs.append(run.stdout)
    assert outs[0] == outs[1]
