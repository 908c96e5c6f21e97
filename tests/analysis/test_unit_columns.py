"""The table the bootstrap resamples, filled a batch at a time from the engine's arrays
(``UnitColumns.put_batch``), holds exactly the doubles filled one document at a time from
:class:`UnitEstimate` objects (``TableLayout.fill``), and rebuilds the same units."""

from __future__ import annotations

import numpy as np
import pytest

from kvcouple.analysis.estimates import SCALARS, BatchUnits
from kvcouple.analysis.units import TableLayout, UnitColumns
from units_helpers import random_unit_batch

_batch = random_unit_batch


@pytest.mark.parametrize(("T", "lags", "window"), [(8, 8, 7), (64, 65, 64), (64, 17, 12)])
@pytest.mark.parametrize("consecutive", [False, True])
def test_a_batch_fills_the_rows_one_document_would(T, lags, window, consecutive):
    rng = np.random.default_rng(T + lags)
    # The table's policy order differs from the batch's: columns go by the table's.
    batch = _batch(rng, 9, ["b", "a"], T, lags)
    layout = TableLayout.of(["a", "b"], T, lags, window)
    views = [BatchUnits(batch, d) for d in range(9)]
    # Consecutive slots are filled in place; others through a block of rows.
    slots = list(range(9)) if consecutive else [4, 0, 8, 2, 6, 1, 7, 3, 5]
    batched = UnitColumns(layout, 9)
    batched.put_batch(slots[:5], views[:5])
    batched.put_batch(slots[5:], views[5:])
    single = UnitColumns(layout, 9)
    for slot, view in zip(slots, views, strict=True):
        single.put(slot, view)
    np.testing.assert_array_equal(batched.matrix, single.matrix)
    np.testing.assert_array_equal(batched.stderr, single.stderr)
    np.testing.assert_array_equal(batched.median_tau, single.median_tau)
    np.testing.assert_array_equal(batched.tail_observed, single.tail_observed)
    assert batched.filled.all()
    # The rebuilt units are the batch's.
    for slot, view in zip(slots, views, strict=True):
        for pol in ("a", "b"):
            got, want = batched.unit(slot, pol), view[pol]
            assert got.values == want.values and got.stderr == want.stderr
            np.testing.assert_array_equal(got.survival, want.survival)
            np.testing.assert_array_equal(got.tv_lag_den, want.tv_lag_den)


def test_a_batch_of_another_shape_or_two_batches_are_refused():
    rng = np.random.default_rng(1)
    layout = TableLayout.of(["a"], 8, 8, 7)
    with pytest.raises(ValueError, match="steps"):
        UnitColumns(layout, 2).put_batch([0], [BatchUnits(_batch(rng, 1, ["a"], 6, 8), 0)])
    one, two = _batch(rng, 1, ["a"], 8, 8), _batch(rng, 1, ["a"], 8, 8)
    with pytest.raises(ValueError, match="one batch"):
        UnitColumns(layout, 2).put_batch([0, 1], [BatchUnits(one, 0), BatchUnits(two, 0)])


def test_per_document_rows_from_the_table_equal_rows_unit_by_unit(tmp_path):
    """The per-document table is read as columns from the analysis's table; the same rows as
    built one UnitEstimate at a time (the path for units held elsewhere)."""
    from dataclasses import replace

    from kvcouple.analysis import analyze
    from kvcouple.analysis.tables import _per_document, table_meta
    from kvcouple.synth.trace_store import write_synthetic_trace_store
    from synth_helpers import two_policy_pairs

    pairs = two_policy_pairs(8, (0.5, 0.1))
    path = write_synthetic_trace_store(
        tmp_path / "s.zarr", pairs, horizon=8, window=3, branches=2, replicates=4, docs=6
    )
    result = analyze(path, n_boot=20)
    (m,) = result.models
    meta = table_meta(result)
    from_table = _per_document(m, meta)
    plain = replace(m, docs=[replace(d, units=dict(d.units)) for d in m.docs])
    one_by_one = _per_document(plain, meta)
    assert len(from_table) == len(one_by_one) == 12
    for a, b in zip(from_table, one_by_one, strict=True):
        assert list(a) == list(b)
        for x, y in zip(a.values(), b.values(), strict=True):
            assert type(x) is type(y) and (x == y or (x != x and y != y)), (x, y)
    assert {r["policy"] for r in from_table} == {"a", "b"}
    assert all(0 <= r["interval_lower_fraction"] <= r["interval_upper_fraction"] <= 1
               for r in from_table)  # fmt: skip


def test_rows_made_when_iterated_behave_as_a_list():
    from kvcouple.analysis.tables import Rows

    def make(n, tag):
        return Rows(["i", "tag"], n, lambda: ({"i": i, "tag": tag} for i in range(n)))

    rows = Rows.chain([make(3, "a"), make(2, "b")])
    want = [{"i": 0, "tag": "a"}, {"i": 1, "tag": "a"}, {"i": 2, "tag": "a"},
            {"i": 0, "tag": "b"}, {"i": 1, "tag": "b"}]  # fmt: skip
    assert len(rows) == 5 and list(rows) == want and list(rows) == want  # passes repeat
    assert rows == want and rows[3] == want[3] and rows[-1] == want[-1] and rows[1:3] == want[1:3]
    with pytest.raises(IndexError):
        rows[5]
    with pytest.raises(ValueError, match="same columns"):
        Rows.chain([make(1, "a"), Rows(["i"], 1, lambda: iter([{"i": 0}]))])


@pytest.mark.parametrize(
    "slots", [list(range(9)), list(range(2, 7)), [4, 0, 8, 2], [3], [], [1, 2, 4, 5]]
)
def test_scalar_rows_are_each_documents_scalars(slots):
    """Consecutive slots (the table after ``finish``) are read as views of it, others
    gathered: either way each document's scalars and standard errors, as :meth:`unit` gives
    them one at a time."""
    rng = np.random.default_rng(5)
    batch = _batch(rng, 9, ["a", "b"], 8, 8)
    columns = UnitColumns(TableLayout.of(["a", "b"], 8, 8, 7), 9)
    columns.put_batch(list(range(9)), [BatchUnits(batch, d) for d in range(9)])
    for pol in ("a", "b"):
        values, stderr = columns.scalar_rows(slots, pol)
        assert values.shape == stderr.shape == (len(slots), len(SCALARS))
        for row, slot in enumerate(slots):
            unit = columns.unit(slot, pol)
            assert values[row].tolist() == [unit.values[k] for k in SCALARS]
            assert stderr[row].tolist() == [unit.stderr[k] for k in SCALARS]
