"""The report reads itself: a title naming what was analysed, the headline in words first
(numbers matching summary.csv), wide quantity x policy tables with short labels and a legend,
captions that explain the collapsed sharp interval, flags, and the same content in Markdown
and HTML."""

from __future__ import annotations

import csv
import re

import pytest

from kvcouple import synth
from kvcouple.analysis import analyze, write_report
from kvcouple.analysis.labels import number, percent
from kvcouple.synth.trace_store import write_synthetic_trace_store

pytest.importorskip("matplotlib")

SNAP = "snapkv:retain=0.5,window=32,kernel=7,pool=avg"  # defaults spelled out, as stored
RECENT = "recent:retain=0.5"


def _store(path, window):
    pairs = {
        SNAP: synth.random_pair(5, 5, seed=2, closeness=0.7),
        RECENT: synth.random_pair(5, 5, seed=2, closeness=0.4),
    }
    return write_synthetic_trace_store(
        path, pairs, horizon=10, window=window, replicates=16, branches=1, docs=12, seed=0
    )


@pytest.fixture(scope="module")
def full_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    store = _store(tmp / "s.zarr", window=None)  # to the horizon: nothing unobserved
    out = write_report(analyze(store, n_boot=200, seed=0), tmp / "r")
    return out, (out / "report.md").read_text(), (out / "report.html").read_text()


def test_title_and_headline_come_first_in_words(full_report):
    out, md, _ = full_report
    lines = md.splitlines()
    assert lines[0] == "# kvcouple report: synthetic, 12 documents, 2 policies"
    headings = [x for x in lines if x.startswith("## ")]
    assert headings[0] == "## Headline"
    summary = {
        (r["policy"], r["quantity"]): float(r["estimate"])
        for r in csv.DictReader((out / "summary.csv").open())
    }
    head = md.split("## Headline", 1)[1].split("\n## ", 1)[0]
    for pol, label in ((SNAP, "snapkv:retain=0.5"), (RECENT, RECENT)):
        sentence = next(x for x in head.splitlines() if x.startswith(f"- **{label}** diverges"))
        # One rule for numbers: three significant figures (percentages too).
        assert f"in {percent(summary[(pol, 'occurrence')])} [" in sentence
        assert f"after divergence {percent(summary[(pol, 'rho')])} [" in sentence
        assert f"E[M]/T = {number(summary[(pol, 'mismatch_fraction')])} [" in sentence
    assert re.search(
        r"- \*\*recent:retain=0\.5\*\* vs \*\*snapkv:retain=0\.5\*\*: E\[M\]/T differs by", head
    )


def test_wide_tables_use_short_labels_with_a_legend(full_report):
    _, md, _ = full_report
    assert "| quantity | snapkv:retain=0.5 | recent:retain=0.5 |" in md
    # Every policy once with its full spec (the legend, in the headline), labels after.
    assert f"| snapkv:retain=0.5 | {SNAP} |" in md and f"| {RECENT} | {RECENT} |" in md
    assert md.count(SNAP) == 1
    row = next(x for x in md.splitlines() if x.startswith("| E[M]/T |"))
    assert len(row.split(" | ")) == 3  # one cell per policy
    # Branches traced to the horizon: no interval rows, and the figure says why.
    assert "| sharp interval" not in md
    assert "collapses to the point estimate" in md
    assert "Lag 0 is the divergence step itself" in md


def test_markdown_and_html_carry_the_same_content(full_report):
    _, md, page = full_report
    title = md.splitlines()[0][2:]
    assert f"<title>{title}</title>" in page and f"<h1>{title}</h1>" in page
    assert re.findall(r"^## (.+)$", md, re.M) == re.findall(r"<h2>(.+?)</h2>", page)
    captions = re.findall(r"^\*Figure (\d+)\.", md, re.M)
    assert captions == re.findall(r"<figcaption><em>Figure (\d+)\.", page)
    assert page.count("data:image/png;base64,") == len(captions) == 6
    md_cells = [
        c.strip() for x in md.splitlines() if x.startswith("| E[M]/T |") for c in x.split("|")[2:-1]
    ]
    for cell in md_cells:  # the interval kept on one line in HTML
        est, ci = cell.split(" ", 1)
        assert f'<td class="num">{est} <span class="ci">{ci}</span></td>' in page


def test_an_unobserved_tail_is_flagged_and_given_as_an_interval(tmp_path):
    store = _store(tmp_path / "w.zarr", window=3)
    out = write_report(analyze(store, n_boot=200, seed=0), tmp_path / "r")
    md = (out / "report.md").read_text()
    flags = md.split("## Flags", 1)[1].split("\n## ", 1)[0]
    assert "traced for L = 3 lags of T = 10" in flags
    assert "sharp interval" in md.split("## Headline", 1)[1].split("\n## ", 1)[0]
    assert "| sharp interval, lower end |" in md
    assert "collapses" not in md


def test_few_documents_are_flagged_with_what_the_coverage_study_measured(full_report, tmp_path):
    _, md, _ = full_report
    flags = md.split("## Flags", 1)[1].split("\n## ", 1)[0]
    assert "12 documents. A sample this small can miss" in flags
    assert "docs/statistics.md" in flags
    pairs = {SNAP: synth.random_pair(5, 5, seed=2, closeness=0.7)}
    store = write_synthetic_trace_store(
        tmp_path / "many.zarr", pairs, horizon=6, replicates=4, branches=1, docs=32, seed=0
    )
    out = write_report(analyze(store, n_boot=200, seed=0), tmp_path / "r", figures=False)
    flags = (out / "report.md").read_text().split("## Flags", 1)[1].split("\n## ", 1)[0]
    assert "A sample this small" not in flags
