"""The per-document files written in a thread while the statistics run
(:class:`kvcouple.analysis.report.DocumentFiles`, ``analyze``'s ``on_documents``): the same
bytes as a report written afterwards, nothing left behind, and an earlier report kept where
the analysis or the writing fails."""

from __future__ import annotations

import gc
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from kvcouple.analysis import analyze
from kvcouple.analysis import engine as engine_module
from kvcouple.analysis import report as report_module
from kvcouple.analysis import tables as tables_module
from kvcouple.analysis.cli import COMMAND_GC_THRESHOLD
from kvcouple.analysis.report import DocumentFiles, write_report
from kvcouple.analysis.results import DocumentsReady
from kvcouple.cli import main
from kvcouple.synth.trace_store import write_synthetic_trace_store

PAIRS = {
    "a": {"P": np.full((5, 5), 0.2), "Q": np.full((5, 5), 0.2) * 0.6 + 0.4 * np.eye(5)},
    "b": {"P": np.full((5, 5), 0.2), "Q": np.full((5, 5), 0.2) * 0.3 + 0.7 * np.eye(5)},
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("docfiles") / "s.zarr"
    write_synthetic_trace_store(path, PAIRS, horizon=6, branches=2, replicates=8, docs=7, seed=3)
    return path


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def test_files_started_beside_the_statistics_equal_a_report_written_after(store, tmp_path):
    seen: list[DocumentsReady] = []
    documents = DocumentFiles(tmp_path / "early")

    def start(ready: DocumentsReady) -> None:
        seen.append(ready)
        documents.start(ready)

    result = analyze(store, n_boot=50, on_documents=start)
    assert len(seen) == 1 and seen[0].models[0].docs is result.models[0].docs
    write_report(result, tmp_path / "early", figures=False, documents=documents)
    write_report(result, tmp_path / "after", figures=False)
    early, after = _files(tmp_path / "early"), _files(tmp_path / "after")
    assert early.keys() == after.keys() and "per_document.csv" in early
    for name in early:
        if name != "report.html":  # its text views hold timings of the page's own making
            assert early[name] == after[name], name
    # No temporary file stays, and results.json is one object whose first key is the table.
    assert not [p for p in (tmp_path / "early").iterdir() if p.name.startswith(".")]
    data = json.loads(early["results.json"])
    assert next(iter(data)) == "per_document" and "meta" in data and "summary" in data
    assert len(data["per_document"]) == 7 * 2


def test_the_command_and_the_functions_give_the_same_files(store, tmp_path, capsys):
    # The command starts the files beside the statistics, which keep to one BLAS thread
    # either way: the same numbers, byte for byte.
    assert main(["analyze", str(store), "--out", str(tmp_path / "cli"), "--no-figures",
                 "--quiet", "--n-boot", "50"]) == 0  # fmt: skip
    capsys.readouterr()
    write_report(analyze(store, n_boot=50), tmp_path / "api", figures=False, html_report=False)
    cli, api = _files(tmp_path / "cli"), _files(tmp_path / "api")
    assert cli.keys() == api.keys()
    for name in cli:
        assert cli[name] == api[name], name


def _earlier_report(store: Path, out: Path) -> dict[str, bytes]:
    write_report(analyze(store, n_boot=50, seed=1), out, figures=False, html_report=False)
    return _files(out)


def test_a_failed_analysis_leaves_the_earlier_report_as_it_was(
    store, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "out"
    before = _earlier_report(store, out)

    def broken(*_args, **_kwargs):
        raise RuntimeError("the statistics failed")

    monkeypatch.setattr(engine_module, "_model_result", broken)
    code = main(["analyze", str(store), "--out", str(out), "--no-figures", "--quiet",
                 "--n-boot", "50"])  # fmt: skip
    assert code != 0 and "the statistics failed" in capsys.readouterr().err
    assert _files(out) == before
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("failing", ["header", "rows", "row by row"])
def test_a_failed_write_is_raised_and_leaves_the_earlier_report(
    store, tmp_path, monkeypatch, failing
):
    """A full disk while the per-document files are written (their header, their rows in
    Rust, or row by row where the rows are not column-wise) is raised; the earlier report in
    ``out`` is left as it was, and nothing hidden is left beside it."""
    out = tmp_path / "out"
    before = _earlier_report(store, out)
    result = analyze(store, n_boot=50)

    def full_disk(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    if failing == "header":
        monkeypatch.setattr(report_module, "write_csv_header", full_disk)
    elif failing == "rows":
        monkeypatch.setattr(tables_module.ColumnRows, "append_to", full_disk)
    else:
        monkeypatch.setattr(tables_module.Rows, "text_columns", lambda self: None)
        real = report_module.write_csv

        def full_for_documents(path, rows, columns=None):
            if path.name.startswith(".per_document.csv"):
                full_disk()
            return real(path, rows, columns)

        monkeypatch.setattr(report_module, "write_csv", full_for_documents)
    with pytest.raises(OSError, match="No space left"):
        write_report(result, out, figures=False, html_report=False)
    assert _files(out) == before
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_a_replaced_report_leaves_nothing_hidden(store, tmp_path):
    """Writing over an earlier report: its replaced files (kept under hidden names until a
    thread removes them) are gone once that thread ends."""
    out = tmp_path / "out"
    _earlier_report(store, out)
    write_report(analyze(store, n_boot=50), out, figures=False, html_report=False)
    for thread in threading.enumerate():
        if thread.name == "kvcouple-replaced-files":
            thread.join()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    assert (out / "per_document.csv").read_text().startswith("model,")


def test_files_of_another_analysis_are_refused(store, tmp_path):
    first = analyze(store, n_boot=50)
    second = analyze(store, n_boot=50)
    documents = DocumentFiles(tmp_path / "out")
    documents.start(DocumentsReady.of(first))
    with pytest.raises(ValueError, match="another analysis"):
        write_report(second, tmp_path / "out", figures=False, documents=documents)
    assert not list((tmp_path / "out").iterdir())
    elsewhere = DocumentFiles(tmp_path / "a")
    elsewhere.start(DocumentsReady.of(first))
    with pytest.raises(ValueError, match="started in"):
        write_report(first, tmp_path / "b", figures=False, documents=elsewhere)
    assert not list((tmp_path / "a").iterdir())
    with pytest.raises(RuntimeError, match="twice"):
        documents.start(DocumentsReady.of(first))


def _markov_pairs() -> dict[str, dict[str, object]]:
    """Two Markov pairs on 6 tokens whose divergence is neither certain nor rare."""
    rng = np.random.default_rng(0)
    P = rng.dirichlet(np.ones(6), size=6)

    def towards(w: float) -> np.ndarray:
        return (1 - w) * P + w * rng.dirichlet(np.ones(6) * 0.3, size=6)

    return {"mild": {"P": P, "Q": towards(0.15)}, "harsh": {"P": P, "Q": towards(0.3)}}


def test_the_statistics_do_not_depend_on_the_blas_threads(tmp_path):
    # From GAUSSIAN_MIN_DOCS documents the intervals multiply the table's columns (546 here)
    # over the documents and decompose their covariance; a product's rounding depends on its
    # BLAS threads, so the statistics keep to one whatever the caller allows.
    from threadpoolctl import threadpool_limits

    from kvcouple.analysis.intervals import GAUSSIAN_MIN_DOCS

    path = write_synthetic_trace_store(
        tmp_path / "many.zarr", _markov_pairs(), horizon=64, window=64, branches=2,
        replicates=2, docs=[d % 6 for d in range(GAUSSIAN_MIN_DOCS)], seed=5,
    )  # fmt: skip
    got = []
    for threads in (1, 4):
        with threadpool_limits(threads, user_api="blas"):
            result = analyze(path)
        assert result.settings["bootstrap_draws"][str(path)] == "gaussian limit"
        write_report(result, tmp_path / f"t{threads}", figures=False, html_report=False)
        got.append(_files(tmp_path / f"t{threads}"))
    for name in got[0]:
        assert got[0][name] == got[1][name], name


def test_the_command_leaves_the_garbage_collector_as_it_found_it(store, tmp_path, monkeypatch):
    """``kvcouple analyze`` keeps its start-up objects out of the garbage collector's walks
    while it runs; a caller that runs ``main`` in-process gets the collector back as it was
    (the command's files are those of the functions:
    test_the_command_and_the_functions_give_the_same_files; numpy's huge-page advice:
    test_memory)."""
    seen: list[int] = []
    thresholds: list[tuple[int, ...]] = []
    real = engine_module.analyze
    before = gc.get_threshold()

    def watched(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        thresholds.append(gc.get_threshold())
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "analyze", watched)
    out = str(tmp_path / "cli")
    assert (
        main(["analyze", str(store), "--out", out, "--no-figures", "--quiet", "--n-boot", "50"])
        == 0
    )
    assert seen[0] > 1000 and gc.get_freeze_count() == 0
    # Young objects collected in larger batches while it ran, and the thresholds restored.
    assert thresholds[0][0] == COMMAND_GC_THRESHOLD != before[0]
    assert thresholds[0][1:] == before[1:] and gc.get_threshold() == before
