"""The registry of quantities (kvcouple.analysis.quantities): every CSV column, report label
and console row names a registered quantity or field; no two names share a definition."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import numpy as np

from kvcouple import synth
from kvcouple.analysis import analyze, quantities, stats, write_report
from kvcouple.analysis.console import DECOMPOSITION_ROWS
from kvcouple.analysis.report_sections import GAP_COLUMNS, SUMMARY_ROWS, WINDOW_ROWS
from kvcouple.synth.trace_store import write_synthetic_trace_store

ROOT = Path(__file__).resolve().parents[2]


def test_no_two_names_share_a_definition_and_units_are_known():
    defs = Counter(q.definition for q in quantities.QUANTITIES.values())
    assert [d for d, n in defs.items() if n > 1] == []
    assert all(q.unit in quantities.UNITS for q in quantities.QUANTITIES.values())
    assert not set(quantities.FIELDS) & set(quantities.QUANTITIES)
    for old, new in {**quantities.DEPRECATED, **quantities.RENAMED_METRICS}.items():
        assert old not in quantities.QUANTITIES or old in quantities.RENAMED_METRICS
        assert new in quantities.QUANTITIES or new.endswith("_tv"), new


def test_report_and_console_rows_name_registered_quantities():
    for rows in (SUMMARY_ROWS, WINDOW_ROWS, DECOMPOSITION_ROWS, GAP_COLUMNS):
        for name, _ in rows:
            assert name in quantities.QUANTITIES, name


def test_every_csv_column_is_registered(tmp_path):
    pairs = {
        "a": synth.random_pair(4, 3, seed=1, closeness=0.7),
        "b": synth.random_pair(4, 3, seed=1, closeness=0.4),
    }
    kw = {"horizon": 6, "replicates": 4, "branches": 1, "docs": 4, "seed": 0}
    store = write_synthetic_trace_store(tmp_path / "s.zarr", pairs, window=None, **kw)
    out = write_report(analyze(store, n_boot=100, seed=0), tmp_path / "out", figures=False)
    named = {"quantity", "term", "curve", "metric"}
    for path in sorted(out.glob("*.csv")):
        with path.open() as f:
            reader = csv.DictReader(f)
            for col in reader.fieldnames or []:
                assert quantities.is_column(col), f"{path.name}: column {col!r}"
            for row in reader:
                for key in named & set(row):
                    assert row[key] in quantities.QUANTITIES, f"{path.name}: {row[key]!r}"


def test_table_and_axis_labels_are_the_registrys():
    """The report's, the console's and the figures' labels come from the registry: a label
    written by hand next to a quantity's name differs from it the day the registry changes."""
    for rows in (SUMMARY_ROWS, WINDOW_ROWS, DECOMPOSITION_ROWS, GAP_COLUMNS):
        for name, shown in rows:
            assert shown == quantities.label(name), (name, shown)
    figures = (ROOT / "python" / "kvcouple" / "analysis" / "figures.py").read_text()
    for q in quantities.QUANTITIES.values():
        # A registered label spelled out in figures.py instead of label(name).
        assert f'"{q.label}"' not in figures, q.name


def test_docs_page_is_the_registry_and_in_the_nav():
    page = (ROOT / "docs" / "quantities.md").read_text()
    assert page == quantities.markdown(), "regenerate docs/quantities.md (see its first line)"
    assert "quantities.md" in (ROOT / "mkdocs.yml").read_text()


def test_every_per_policy_quantity_carries_its_formula():
    # A per-policy quantity is one registry entry: its formula lives there, so the analysis
    # computes every one (no KeyError at run time for a quantity added without a formula).

    for q in quantities.SUMMARY:
        assert q.formula is not None, q.name
        fn = stats.quantity_fn("p", q.name, 4)
        assert np.shape(fn(lambda col: np.full(3, 0.5))) == (3,), q.name


def test_one_decomposition_for_the_exact_solver_the_estimates_and_the_analysis():
    # mismatch fraction, first mismatch, exposure and rho: derived by kvcouple.decomposition
    # for all three, equal to the last bit.
    from kvcouple import decomposition as dc

    pair = synth.random_pair(4, 3, seed=1)
    exact = synth.exact(pair, 12, 4)
    post = exact.window_contribution + exact.tail_contribution
    parts = dc.parts(exact.expected_mismatches, exact.occurrence, exact.occupation, post, 12)
    assert parts == {k: getattr(exact, k) for k in parts}
    est = synth.estimate(pair, 12, 4, replicates=50, seed=0)
    columns = {k: est.mean[k] for k in ("expected_mismatches", "occurrence", "occupation")}
    columns["post_mismatches"] = float(np.mean(est.values["window_contribution"]
                                               + est.values["tail_contribution"]))  # fmt: skip
    for name in parts:
        formula = quantities.quantity(name).formula
        assert formula is not None
        assert float(formula(columns.__getitem__, 12.0)) == est.mean[name], name
