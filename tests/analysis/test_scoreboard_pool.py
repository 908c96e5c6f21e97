"""The scoreboard in bounded memory: past EXACT_STEPS pooled steps the percentiles come from a
histogram of the steps' float32 values; each stays within its stated relative resolution of
numpy's exact percentile, maximum and minimum stay exact, and neither the means nor the
percentiles depend on the order the documents arrive in."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvcouple.analysis import scoreboard as sb


def _steps(rng: np.random.Generator, n: int) -> np.ndarray:
    # KL-like: many tiny values, a heavy tail, exact zeros and one +inf (allowed in kl_pq).
    v = rng.lognormal(-6.0, 3.0, n).astype(np.float32)
    v[rng.random(n) < 0.05] = 0.0
    return v


def _exact_bound(pooled: np.ndarray, pct: float) -> float:
    """The percentile's two order statistics: the histogram's error is at most half a bin of
    the larger."""
    s = np.sort(pooled.astype(np.float64))
    pos = pct / 100 * (len(s) - 1)
    a, b = s[math.floor(pos)], s[min(math.floor(pos) + 1, len(s) - 1)]
    # Below float32's smallest normal number (subnormals) a value counts as 0.
    return sb.HISTOGRAM_RESOLUTION * max(abs(a), abs(b)) + float(np.finfo(np.float32).tiny)


@pytest.mark.parametrize("signed", [False, True])
def test_histogram_percentiles_are_within_their_resolution(monkeypatch, signed):
    monkeypatch.setattr(sb, "EXACT_STEPS", 1000)
    monkeypatch.setattr(sb, "COUNT_BLOCK", 3000)  # several blocks counted
    rng = np.random.default_rng(3)
    parts = [_steps(rng, int(rng.integers(1, 700))) for _ in range(40)]
    if signed:  # delta p: both signs, in [-1, 1]
        parts = [(p.clip(0, 1) * rng.choice([-1, 1], p.size)).astype(np.float32) for p in parts]
    pool = sb.PooledSteps()
    for p in parts:
        pool.add(p)
    assert not pool.exact
    pooled = np.concatenate(parts).astype(np.float64)
    for pct in (0.0, 0.1, 1.0, 5.0, 10.0, 25.0, 50.0, 75.0, 90.0, 99.0, 99.9, 100.0):
        exact = float(np.percentile(pooled, pct))
        got = pool.percentile(pct)
        assert abs(got - exact) <= _exact_bound(pooled, pct), (pct, got, exact)
    assert pool.percentile(100.0) == pooled.max() and pool.percentile(0.0) == pooled.min()


def test_exact_below_the_cap_and_inf_is_kept():
    rng = np.random.default_rng(4)
    v = _steps(rng, 5000)
    v[17] = np.inf
    pool = sb.PooledSteps()
    pool.add(v[:2000])
    pool.add(v[2000:])
    assert pool.exact
    for pct in (0.0, 50.0, 99.9):
        assert pool.percentile(pct) == np.percentile(v.astype(np.float64), pct)
    # numpy's interpolation gives NaN at 100 (inf - inf); the maximum is inf.
    assert pool.percentile(100.0) == np.inf


def test_histogram_keeps_inf_as_the_maximum(monkeypatch):
    monkeypatch.setattr(sb, "EXACT_STEPS", 10)
    v = np.array([0.0, 1e-3, 2.0, np.inf] * 10, np.float32)
    pool = sb.PooledSteps()
    pool.add(v)
    assert not pool.exact
    assert pool.percentile(100.0) == np.inf and pool.percentile(99.9) == np.inf
    assert pool.percentile(0.0) == 0.0 and pool.percentile(1.0) == 0.0


def _scores(rng: np.random.Generator, docs: int) -> list[dict[str, sb.DocScores]]:
    out = []
    for _ in range(docs):
        out.append(
            {
                pol: sb.DocScores(
                    _steps(rng, int(rng.integers(0, 300))).astype(np.float64),
                    None,
                    None,
                )
                for pol in ("a", "b")
            }
        )
    for d in out:  # agree and dp recorded for every document
        for s in d.values():
            s.agree = rng.random(s.kl.size) < 0.9
            s.dp = rng.uniform(-1, 1, s.kl.size).astype(np.float32).astype(np.float64)
    return out


@pytest.mark.parametrize("cap", [1 << 22, 500])
def test_the_pool_does_not_depend_on_arrival_order(monkeypatch, cap):
    monkeypatch.setattr(sb, "EXACT_STEPS", cap)
    rng = np.random.default_rng(5)
    docs = _scores(rng, 60)
    in_order = sb.scoreboard_rows("m", ["a", "b"], docs)
    pool = sb.ScoreboardPool(["a", "b"], len(docs))
    for slot in rng.permutation(len(docs)):
        pool.put(int(slot), docs[slot])
    assert pool.rows("m") == in_order
    # In batches of any size, in any order: the same rows.
    batched = sb.ScoreboardPool(["a", "b"], len(docs))
    order = [int(i) for i in rng.permutation(len(docs))]
    for start, size in ((0, 7), (7, 1), (8, 30), (38, 22)):
        part = order[start : start + size]
        batched.put_many(part, [docs[i] for i in part])
    assert batched.rows("m") == in_order
    # Means and standard errors over documents, and the RMS, are exact in both modes.
    kl = {(r["policy"], r["quantity"], r["statistic"]): r for r in in_order}
    means = [d["a"].kl.mean() for d in docs if d["a"].kl.size]
    assert kl[("a", "kl_pq", "mean")]["estimate"] == pytest.approx(np.mean(means), rel=1e-12)
    assert kl[("a", "kl_pq", "mean")]["se"] == pytest.approx(
        np.std(means, ddof=1) / math.sqrt(len(means)), rel=1e-12
    )
    dp = np.concatenate([d["b"].dp for d in docs])
    assert kl[("b", "delta_p", "rms")]["estimate"] == pytest.approx(
        np.sqrt(np.mean(dp**2)), rel=1e-12
    )
    resolution = 0.0 if cap > dp.size else sb.HISTOGRAM_RESOLUTION
    assert kl[("b", "delta_p", "median")]["relative_error"] == resolution
    assert kl[("b", "delta_p", "max")]["relative_error"] == 0.0


def test_a_batch_from_its_stacks_folds_as_its_documents_do():
    """ScoreBatch (a summary batch's steps straight from the engine's stacks) gives each
    document the same DocScores as doc_scores, and put_batch the same rows as put_many of
    the documents one by one (unseen steps, -1 tokens and NaN KL left out)."""
    from kvcouple.store.engine_reads import SummaryBatch

    rng = np.random.default_rng(9)
    docs, P, R, T = 11, 2, 3, 7
    tokens = rng.integers(-1, 5, (docs, P, R, T))
    kl = rng.lognormal(-5.0, 2.0, (docs, P, R, T)).astype(np.float32)
    kl[rng.random(kl.shape) < 0.1] = np.nan
    tokens[4] = -1  # a document with no path step at all
    agree = rng.random((docs, P, R, T)) < 0.7
    stacks = {"tokens": tokens, "kl_pq": kl, "top1_agree": agree}
    summaries = SummaryBatch(stacks, docs)

    class Reader:  # what doc_scores reads of a summary store's reader
        policies = ["a", "b"]
        record = "summary"

    one_by_one = [sb.doc_scores(Reader(), d, s) for d, s in enumerate(summaries)]
    batch = sb.ScoreBatch(Reader.policies, stacks)
    for d, want in enumerate(one_by_one):
        got = sb.BatchScores(batch, d)
        assert list(got) == ["a", "b"]
        for pol in ("a", "b"):
            np.testing.assert_array_equal(got[pol].kl, want[pol].kl)
            np.testing.assert_array_equal(got[pol].agree, want[pol].agree)
            assert got[pol].dp is None and want[pol].dp is None
    slots = list(rng.permutation(docs + 5)[:docs])
    a, b = (
        sb.ScoreboardPool(Reader.policies, docs + 5),
        sb.ScoreboardPool(Reader.policies, docs + 5),
    )
    a.put_many(slots, one_by_one)
    b.put_batch(slots, batch)
    rows_a, rows_b = a.rows("m"), b.rows("m")
    assert rows_a == rows_b and any(r["quantity"] == "same_top" for r in rows_b)
    with pytest.raises(ValueError, match="slots for a batch"):
        b.put_batch(slots[:-1], batch)


def test_the_rust_histogram_counts_as_numpy_bincount_of_the_sortable_keys():
    """_core.count_float_keys (the pooled steps' histogram) against numpy: keys that keep the
    values' order (negative values' bits inverted, others' sign bit set), top bits binned;
    counts add in place; a bin array that does not fit the bits is refused."""
    from kvcouple import _core
    from kvcouple.errors import ShapeError

    rng = np.random.default_rng(2)
    v = np.concatenate([_steps(rng, 5000), -_steps(rng, 3000), [np.inf, -np.inf, 0.0, -0.0]])
    v = v.astype(np.float32)
    bits = v.view(np.uint32)
    keys = np.where(bits >> 31, ~bits, bits | np.uint32(1 << 31))
    by_key = v[np.argsort(keys)].astype(np.float64)
    assert np.all(np.diff(by_key) >= 0)  # the keys keep the values' order
    want = np.bincount(keys >> np.uint32(32 - 12), minlength=1 << 12)
    counts = np.zeros(1 << 12, np.int64)
    _core.count_float_keys(v, counts, 12)
    np.testing.assert_array_equal(counts, want)
    _core.count_float_keys(v[:10], counts, 12)
    assert counts.sum() == v.size + 10
    with pytest.raises(ShapeError, match="bins for 12 bits"):
        _core.count_float_keys(v, np.zeros(100, np.int64), 12)


def test_path_steps_refuses_arrays_of_different_shapes():
    from kvcouple import _core

    kl = np.zeros((2, 2, 3))
    with pytest.raises(ValueError, match="one shape"):
        _core.path_steps(kl, np.zeros((2, 2, 4), np.int32))
    with pytest.raises(ValueError, match="one shape"):
        _core.path_steps(kl, np.zeros((2, 2, 3), np.int32), np.zeros((2, 3), bool))
    with pytest.raises(ValueError, match="segments"):
        _core.segment_sums(np.zeros(3), np.array([1, 1], np.int64))
    with pytest.raises(ValueError, match="float32 or float64"):
        _core.path_steps(kl.astype(np.int32), np.zeros((2, 2, 3), np.int32))


def test_path_steps_read_stored_float32_as_their_doubles():
    """KL stored as float32 is read as it is: the same counts, sums and pooled steps as its
    doubles given."""
    from kvcouple import _core

    rng = np.random.default_rng(3)
    kl = rng.exponential(0.3, (5, 2, 4, 16)).astype(np.float32)
    kl[rng.random(kl.shape) < 0.1] = np.nan
    tokens = np.where(rng.random(kl.shape) < 0.1, -1, 7).astype(np.int32)
    agree = rng.random(kl.shape) < 0.5
    narrow = _core.path_steps(kl, tokens, agree)
    wide = _core.path_steps(kl.astype(np.float64), tokens, agree)
    assert narrow.keys() == wide.keys()
    for key in narrow:  # arrays, or one array per policy
        a, b = narrow[key], wide[key]
        for x, y in zip(a, b, strict=True) if isinstance(a, list) else [(a, b)]:
            np.testing.assert_array_equal(x, y, err_msg=key)
