"""The table's moments made while its rows come in (``RunningMoments``, ``UnitColumns``'s
``settle``) equal the two passes over the finished table (``TableMoments.of``) up to
rounding: NaN and inf entries, columns with no finite entry, constant columns (exactly),
blocks of any size, rows settled in any order or never filled (damaged documents). The
analysis's intervals from them equal those from the two passes."""

from __future__ import annotations

import numpy as np
import pytest

from kvcouple import analysis, synth
from kvcouple.analysis.estimates import BatchUnits
from kvcouple.analysis.moments import RunningMoments, TableMoments
from kvcouple.analysis.units import TableLayout, UnitColumns
from kvcouple.synth import trace_store
from units_helpers import random_unit_batch


def _assert_moments_close(got: TableMoments, want: TableMoments) -> None:
    np.testing.assert_array_equal(got.count, want.count)
    np.testing.assert_array_equal(got.positive, want.positive)
    np.testing.assert_array_equal(np.isnan(got.point), np.isnan(want.point))
    finite = ~np.isnan(want.point)
    np.testing.assert_allclose(got.point[finite], want.point[finite], rtol=1e-12, atol=1e-12)
    # Each entry against its columns' scale (a product of two centred sums); a column that
    # does not vary has only the two passes' rounding (the running sums give it exactly 0).
    scale = np.sqrt(np.outer(np.diag(want.gram), np.diag(want.gram)))
    floor = 1e-15 * scale.max()
    assert np.all(np.abs(got.gram - want.gram) <= 1e-9 * scale + floor), np.max(
        np.abs(got.gram - want.gram) / np.where(scale > 0, scale, 1)
    )


def _awkward_table(rng: np.random.Generator, rows: int, nan_rate: float) -> np.ndarray:
    cols = 9
    # Offsets 1e4 times the spreads: a one-pass sum about 0 would lose 8 of 16 digits.
    mat = rng.normal(0.0, 1.0, (rows, cols)) * rng.uniform(0.1, 10.0, cols)
    mat += rng.uniform(-1e3, 1e3, cols)
    mat[rng.random(mat.shape) < nan_rate] = np.nan
    mat[:, 2] = np.nan  # no finite entry
    mat[:, 3] = 0.1  # constant, not a binary fraction
    mat[:, 4] = np.where(rng.random(rows) < 0.5, np.nan, 64.0)  # constant where finite
    mat[:, 7] = np.where(rng.random(rows) < 0.3, 0.0, np.abs(mat[:, 7]))  # 0 is not positive
    if nan_rate:
        mat[rng.integers(rows), 5] = np.inf
        mat[rng.integers(rows), 6] = -np.inf
    return mat


@pytest.mark.parametrize("nan_rate", [0.0, 0.02, 0.4])
@pytest.mark.parametrize("block", [1, 7, 250, 5000])
def test_running_moments_equal_the_two_passes(nan_rate, block):
    rng = np.random.default_rng(int(nan_rate * 100) + block)
    mat = _awkward_table(rng, 1200, nan_rate)
    running = RunningMoments(mat.shape[1])
    running.add(mat[:0])  # an empty block adds nothing
    for start in range(0, len(mat), block):
        running.add(mat[start : start + block])
    got, want = running.moments(), TableMoments.of(mat)
    _assert_moments_close(got, want)
    assert running.rows == len(mat)
    # A column that does not vary has no spread at all (the Gaussian limit keeps it exact).
    assert got.gram[3, 3] == 0.0 and got.point[3] == 0.1
    assert got.gram[4, 4] == 0.0 and got.point[4] == 64.0
    # The documents with a positive entry (NaN is not, inf is): the curves' counts.
    np.testing.assert_array_equal(got.positive, (mat > 0).sum(0))
    assert got.positive[2] == 0 and got.positive[3] == len(mat)


def test_a_block_of_another_width_is_refused():
    with pytest.raises(ValueError, match="3 columns"):
        RunningMoments(3).add(np.zeros((2, 4)))


def _batch(rng, docs, T, lags):
    return random_unit_batch(rng, docs, ["a"], T, lags)


def _fill(order: list[list[int]], damaged: set[int], slots: int, seed: int) -> UnitColumns:
    """A table of ``slots`` documents whose batches come back in ``order``; the slots in
    ``damaged`` come back with nothing to fill (settled, never filled)."""
    layout = TableLayout.of(["a"], 8, 8, 7)
    columns = UnitColumns(layout, slots, moments=True)
    columns._block = 5  # blocks of five slots: many blocks from few documents
    rng = np.random.default_rng(seed)
    batch = _batch(rng, slots, 8, 8)
    for group in order:
        good = [s for s in group if s not in damaged]
        columns.put_batch(good, [BatchUnits(batch, s) for s in good])
        columns.settle(group)
    return columns


def test_rows_settled_in_any_order_give_the_same_moments_as_the_finished_table():
    slots = 23
    damaged = {3, 11, 12, 22}
    in_order = [list(range(i, min(i + 4, slots))) for i in range(0, slots, 4)]
    shuffled = [in_order[k] for k in (3, 0, 5, 1, 4, 2)]
    a = _fill(in_order, damaged, slots, 1)
    b = _fill(shuffled, damaged, slots, 1)
    got_a, got_b = a.moments(), b.moments()
    assert got_a is not None and got_b is not None
    # Blocks are added in slot order whatever order the batches came in: the same doubles.
    np.testing.assert_array_equal(got_a.gram, got_b.gram)
    np.testing.assert_array_equal(got_a.point, got_b.point)
    kept = [s for s in range(slots) if s not in damaged]
    _assert_moments_close(got_a, TableMoments.of(a.matrix[kept]))


def test_moments_are_refused_when_a_row_came_after_its_block():
    layout = TableLayout.of(["a"], 8, 8, 7)
    columns = UnitColumns(layout, 10, moments=True)
    columns._block = 5
    batch = _batch(np.random.default_rng(2), 10, 8, 8)
    columns.put_batch([0, 1, 2, 3], [BatchUnits(batch, s) for s in range(4)])
    columns.settle(range(5))  # slot 4 settled as damaged: the block of 0..4 is added
    columns.put_batch([4], [BatchUnits(batch, 4)])  # then filled after all
    with pytest.raises(RuntimeError, match="after its block"):
        columns.moments()


def test_without_moments_nothing_is_made():
    columns = UnitColumns(TableLayout.of(["a"], 8, 8, 7), 4)
    columns.settle(range(4))
    assert not columns.running and columns.moments() is None


def test_an_analysis_of_many_documents_has_the_intervals_of_the_two_passes(tmp_path, monkeypatch):
    """Through analyze with the Gaussian limit: the moments made while reading (a damaged
    document skipped) give the intervals the finished table's two passes give."""
    import zarr

    from kvcouple.analysis import analyze, intervals
    from kvcouple.analysis import stats as st
    from kvcouple.analysis.bootstrap import bootstrap_table
    from kvcouple.synth.trace_store import write_synthetic_trace_store
    from synth_helpers import two_policy_pairs

    pairs = two_policy_pairs(8, (0.5, 0.1))
    path = write_synthetic_trace_store(
        tmp_path / "s.zarr", pairs, horizon=8, window=3, branches=2, replicates=4, docs=40
    )
    kl = zarr.open_group(str(path), mode="r+")["kl_pq"]  # a negative KL: damaged
    block = kl[17]
    block[0, 0] = -1.0
    kl[17] = block
    monkeypatch.setattr(intervals, "GAUSSIAN_MIN_DOCS", 30)

    two_passes = TableMoments.of
    width = []

    def no_second_pass(mat):
        # Combinations of a few columns (the median step's tests) have moments of their own.
        if width and mat.shape[1] == width[0]:
            raise AssertionError("the table's moments were made again after the read")
        return two_passes(mat)

    plain = analyze(path, n_boot=10, allow_incomplete=True)
    width.append(plain.models[0].table.matrix()[1].shape[1])
    with monkeypatch.context() as patch:
        patch.setattr(TableMoments, "of", no_second_pass)
        result = analyze(path, n_boot=400, allow_incomplete=True)
    (m,) = result.models
    assert m.bootstrap.gaussian and len(m.docs) == 39
    two_pass = bootstrap_table(m.table, 400, 0, 0.95, "studentized")
    _assert_moments_close(m.bootstrap.moments, two_pass.moments)
    want = st.summarise(two_pass, m.policies, m.horizon, m.window + 1, None)["summary"]
    for got, exp in zip(m.tables["summary"], want, strict=True):
        assert got["quantity"] == exp["quantity"] and got["policy"] == exp["policy"]
        for key in ("estimate", "ci_low", "ci_high"):
            assert got[key] == pytest.approx(exp[key], rel=1e-9, abs=1e-12, nan_ok=True), (
                got,
                exp,
            )
    _assert_curves_count_the_positive_entries(m)


def _assert_curves_count_the_positive_entries(m) -> int:
    """The curves' documents (counted with the moments as the rows came in): a hazard's those
    not certainly diverged before its step, a lag's branch TV those whose branches reached
    it, the table's positive entries. Returns the points informed by fewer than all."""
    names, mat = m.table.matrix()
    column = {n: j for j, n in enumerate(names)}
    informed = {"hazard": lambda p, x: f"{p}|S|{x - 1}", "branch_tv": lambda p, x: f"{p}|tvd|{x}"}
    fewer = 0
    for row in m.tables["curves"]:
        if row["curve"] in informed:
            j = column[informed[row["curve"]](row["policy"], row["x"])]
            assert row["n_docs"] == int((mat[:, j] > 0).sum()), row
            fewer += row["n_docs"] < len(m.docs)
    return fewer


def test_the_curves_count_the_documents_that_inform_them(tmp_path, monkeypatch):
    """Paths that stop early (absorbing EOS): later lags' branch TVs are informed by fewer
    documents, counted as the rows come in (the Gaussian limit's moments)."""
    pairs = {
        "a": synth.random_pair(5, 3, seed=1, closeness=0.5, absorbing=True),
        "b": synth.random_pair(5, 3, seed=2, closeness=0.3, absorbing=True),
    }
    path = trace_store.write_synthetic_trace_store(
        tmp_path / "s.zarr", pairs, horizon=12, branches=2, replicates=4, docs=40, seed=5
    )
    monkeypatch.setattr(analysis.intervals, "GAUSSIAN_MIN_DOCS", 30)
    (m,) = analysis.analyze(path, n_boot=50).models
    assert m.bootstrap.gaussian and m.bootstrap.moments is not None
    assert _assert_curves_count_the_positive_entries(m) > 0
