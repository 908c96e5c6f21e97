"""Large tables written column-wise in Rust (:class:`kvcouple.analysis.tables.ColumnRows`):
the same bytes as ``csv.writer`` and the same text as ``json.dumps`` of the rows, on awkward
numbers and labels; the per-document table of a report identical either way."""

from __future__ import annotations

import csv
import io
import json
import math

import numpy as np
import pytest

from kvcouple.analysis import analyze, text_html
from kvcouple.analysis import tables as tb
from kvcouple.analysis.report import write_report
from kvcouple.analysis.tables import ColumnRows, json_safe
from kvcouple.errors import InvalidInputError
from kvcouple.synth.trace_store import write_synthetic_trace_store

AWKWARD_FLOATS = [
    0.0, -0.0, 1.0, 0.1, 1 / 3, 2.0 / 3e-7, 1e-4, 1e-5, 9.999e-5, 1e15, 1e16, 123456789.125,
    5e-324, 1.7976931348623157e308, -2.5e-300, math.nan, math.inf, -math.inf,
]  # fmt: skip
AWKWARD_LABELS = ["plain", "a,b", 'say "hi"', "line\nbreak", "tab\there", "é€😀", "\x01", ""]


def _table(rng: np.random.Generator, rows: int) -> tuple[ColumnRows, list[dict]]:
    numbers = np.column_stack(
        [
            rng.choice(AWKWARD_FLOATS, rows),
            rng.normal(0, 1, rows) * 10.0 ** rng.integers(-12, 20, rows),
        ]
    )
    flags = rng.random((rows, 1)) < 0.5
    codes = np.column_stack([rng.integers(len(AWKWARD_LABELS), size=rows), np.zeros(rows)]).astype(
        np.uint32
    )
    labels = [AWKWARD_LABELS, ["constant"]]
    spec = [("id", "label", 0), ("x", "number", 0), ("y", "number", 1), ("ok", "flag", 0)]
    spec += [("meta", "label", 1)]
    text = ColumnRows(spec, numbers, flags, codes, labels)
    dicts = [
        {
            "id": AWKWARD_LABELS[codes[r, 0]],
            "x": float(numbers[r, 0]),
            "y": float(numbers[r, 1]),
            "ok": bool(flags[r, 0]),
            "meta": "constant",
        }
        for r in range(rows)
    ]
    return text, dicts


def test_csv_is_what_csv_writer_writes():
    text, dicts = _table(np.random.default_rng(0), 5000)
    want = io.StringIO(newline="")
    csv.writer(want).writerows(d.values() for d in dicts)
    got = b"".join(text.blocks("csv", rows=777)).decode("utf-8")
    assert got == want.getvalue()


def test_json_rows_are_what_json_dumps_writes():
    text, dicts = _table(np.random.default_rng(1), 5000)
    want = json.dumps(json_safe(dicts))[1:-1]
    got = ", ".join(b.decode("ascii") for b in text.blocks("json", rows=777))
    assert got == want
    assert json.loads("[" + got + "]") == json_safe(dicts)


@pytest.mark.parametrize("threads", [0, 1])
@pytest.mark.parametrize("block_rows", [1, 777, 4096])
def test_both_files_in_one_pass_are_what_each_format_writes(tmp_path, block_rows, threads):
    """``append_to``: the CSV and JSON rows appended after what the files hold, the bytes
    each format writes alone, whatever the block of rows."""
    text, _ = _table(np.random.default_rng(4), 3000)
    csv_path, json_path = tmp_path / "t.csv", tmp_path / "t.json"
    csv_path.write_text("header\r\n")
    json_path.write_text("[")
    text._engine.append_to(csv_path, json_path, block_rows, threads)
    assert csv_path.read_bytes() == b"header\r\n" + text.text("csv", 0, len(text))
    assert json_path.read_bytes() == b"[" + text.text("json", 0, len(text))
    with pytest.raises(OSError, match="missing.csv"):
        text.append_to(tmp_path / "missing.csv", json_path)


def test_chained_tables_keep_their_labels():
    rng = np.random.default_rng(2)
    (a, da), (b, db) = _table(rng, 50), _table(rng, 70)
    b = ColumnRows(
        b.columns, b.numbers, b.flags, b.codes, [["other", *AWKWARD_LABELS], b.labels[1]]
    )
    db = [{**d, "id": (["other", *AWKWARD_LABELS])[b.codes[i, 0]]} for i, d in enumerate(db)]
    both = ColumnRows.chain([a, b])
    assert both is not None
    want = json.dumps(json_safe(da + db))[1:-1]
    assert ", ".join(x.decode("ascii") for x in both.blocks("json")) == want


def test_bad_columns_are_refused():
    text, _ = _table(np.random.default_rng(3), 10)
    with pytest.raises(ValueError, match="format"):
        text.text("xml", 0, 10)
    with pytest.raises(Exception, match="rows 0..11"):
        text.text("csv", 0, 11)
    bad = ColumnRows(text.columns, text.numbers, text.flags, text.codes + 100, text.labels)
    with pytest.raises(Exception, match="label code"):
        bad.text("csv", 0, 10)
    wide = ColumnRows([("x", "number", 5)], text.numbers, text.flags, text.codes, text.labels)
    with pytest.raises(Exception, match="reads"):
        wide.text("csv", 0, 10)


def test_report_per_document_table_is_the_same_either_way(tmp_path, monkeypatch):
    pairs = {
        "a": {"P": np.full((5, 5), 0.2), "Q": np.full((5, 5), 0.2) * 0.6 + 0.4 * np.eye(5)},
        "b": {"P": np.full((5, 5), 0.2), "Q": np.full((5, 5), 0.2) * 0.3 + 0.7 * np.eye(5)},
    }
    store = write_synthetic_trace_store(
        tmp_path / "s.zarr", pairs, horizon=6, branches=2, replicates=8, docs=5, seed=1
    )
    result = analyze(store, n_boot=100)
    rows = tb.tidy_tables(result)["per_document"]
    assert rows.text_columns() is not None  # type: ignore[attr-defined]
    fast = write_report(result, tmp_path / "fast", figures=False, html_report=False)
    m = result.models[0]
    by_column = text_html._estimates(result, m, tb.tidy_tables(result))
    monkeypatch.setattr(tb.Rows, "text_columns", lambda self: None)
    slow = write_report(result, tmp_path / "slow", figures=False, html_report=False)
    by_row = text_html._estimates(result, m, tb.tidy_tables(result))
    assert by_column.keys() == by_row.keys()
    for q in by_row:  # report.html's per-document estimates, either way
        np.testing.assert_array_equal(by_column[q], by_row[q], err_msg=q)
    assert np.isfinite(by_row["rmst"]).all()
    for name in ("per_document.csv", "results.json"):
        assert (fast / name).read_bytes() == (slow / name).read_bytes(), name
    with pytest.raises(InvalidInputError):
        write_report(result, fast / "per_document.csv")


def test_every_kind_of_double_as_repr_writes_it():
    # Random bit patterns (every exponent, subnormals) and large numbers with halves and
    # quarters, where two shortest digit strings tie and repr takes the even one.
    rng = np.random.default_rng(4)
    bits = rng.integers(0, 2**63 - 1, 100_000, dtype=np.int64).view(np.float64)
    halves = np.round(rng.normal(0, 1e17, 50_000)) / 8
    # Magnitudes on both sides of fixed notation's ends (1e-4 and 1e16), and the doubles
    # next to those ends, where the writer switches between Ryu's layout and its own.
    spread = rng.normal(0, 1, 100_000) * 10.0 ** rng.uniform(-6, 18, 100_000)
    ends = np.array([1e-4, 1e16, 1e-5, 1e15])
    edges = np.concatenate([ends, np.nextafter(ends, 0), np.nextafter(ends, np.inf)])
    values = np.concatenate([bits[np.isfinite(bits)], -bits[:1000], halves, spread, edges, -edges])
    none = np.zeros((len(values), 0), np.uint32)
    text = ColumnRows([("x", "number", 0)], values[:, None], values[:, None] > 0, none, [])
    got = b"".join(text.blocks("csv")).decode().split("\r\n")[:-1]
    assert got == [repr(float(v)) for v in values]
