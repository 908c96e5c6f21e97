"""The report's text views and per-document table (report.html): P's and Q's text around the
first divergence, every document linked to its view, hostile ids and generated text escaped."""

from __future__ import annotations

import math
import re

import pytest

from kvcouple.analysis.text_html import view_html, visible
from kvcouple.analysis.text_view import BranchView, DocumentView, Token

HOSTILE = ["<script>alert(1)</script>", "\x1b[31m", "\u202eevil", "&amp;", "a\x00b", "\n"]


def _view() -> DocumentView:
    shared = [Token(1, 5, "Hello", 0.01), Token(2, 6, " <b>", 0.3)]
    p = [Token(3, 7 + i, t, 0.9) for i, t in enumerate(HOSTILE)]
    q = [Token(3, 20, "</div></div><img src=x onerror=alert(2)>", math.nan)]
    view = DocumentView(
        "<i>doc</i>\x07", "recent:retain=0.5", 0, 8, True, "text", "<p>prompt\x1b", 9
    )
    view.branches.append(BranchView(1, 3, shared, p, q))
    return view


def test_a_view_escapes_markup_and_control_characters():
    page = view_html(_view(), visible("<i>doc</i>\x07"))
    assert "<script>" not in page and "<img" not in page and "<b>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;img src=x onerror=alert(2)&gt;" in page
    for raw in ("\x1b", "\u202e", "\x00", "\x07"):
        assert raw not in page
    assert "\\x1b[31m" in page and "\\u202eevil" in page and "a\\x00b" in page
    assert "&amp;amp;" in page  # the token's text "&amp;", shown as written
    assert "&lt;i&gt;doc&lt;/i&gt;\\x07" in page
    assert "first divergence at step 3" in page and page.count("&#9654;") == 3
    assert 'class="s5"' in page  # TV 0.9 shaded darkest; NaN unshaded


@pytest.mark.torch
def test_the_report_shows_the_text_and_a_table_of_every_document(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvcouple.analysis import analyze, write_report
    from text_helpers import DOCS, POLICIES, cached_text_store

    store = cached_text_store("summary")
    out = write_report(analyze(store, n_boot=20, seed=0), tmp_path / "r", figures=False)
    page = (out / "report.html").read_text()
    md = (out / "report.md").read_text()
    assert "## What diverged" in md and "kvcouple show" in md
    assert "<h2>What diverged</h2>" in page and "diverged earliest" in page
    assert "diverged latest" in page and 'class="tv-sides"' in page
    assert "<script>alert" not in page and "\x1b" not in page and "\x07" not in page
    # Every (document, policy) has a row; every document links to a view that exists.
    table = page.split('<table class="sortable">', 1)[1].split("</table>", 1)[0]
    assert table.count("<tr>") == 1 + len(DOCS) * len(POLICIES)
    anchors = set(re.findall(r'href="#(kv-view-[0-9-]+)"', table))
    assert len(anchors) == len(DOCS)
    for a in anchors:
        assert f'<details class="tv-doc" id="{a}">' in page
    assert visible(DOCS[0][0]) in table and visible("esc\\x1b[31mred") in table
    # The prompt's hostile markup is escaped in its folded view.
    assert "&lt;b&gt;thank you&lt;/b&gt; &amp; for the draft" in page
    assert len(page.encode()) < 200_000


def test_a_report_of_100_documents_stays_light(tmp_path):
    """100 documents x 3 policies, T = 32, every document's view written: the page (without
    figures) stays under 700 kB (measured 560 kB; the figures add about 375 kB)."""
    from kvcouple.analysis import analyze, write_report
    from text_helpers import synthetic_text_store

    store = synthetic_text_store(tmp_path / "s.zarr", docs=100)
    out = write_report(analyze(store, n_boot=20, seed=0), tmp_path / "r", figures=False)
    page = (out / "report.html").read_text()
    assert page.count('<details class="tv-doc"') == 100
    assert page.count("<tr><td><a href=") == 300
    assert len(page.encode()) < 700_000, len(page.encode())


def test_views_from_a_batch_read_equal_views_read_alone(tmp_path):
    """The report reads its views' variables a batch of documents per engine call; each view
    is the one read alone (a synthetic store of 40 documents: sharded)."""

    from kvcouple.analysis.text_view import VIEW_READ, document_view
    from kvcouple.store.reader import TraceStoreReader
    from kvcouple.synth.trace_store import write_synthetic_trace_store
    from synth_helpers import two_policy_pairs

    pairs = two_policy_pairs(3, (0.5, 0.9))
    path = write_synthetic_trace_store(
        tmp_path / "s.zarr", pairs, horizon=8, window=4, branches=2, replicates=3, docs=40
    )
    reader = TraceStoreReader(path)
    docs = list(range(0, 40, 3))
    batch = reader.read_summaries(docs, VIEW_READ)
    assert batch is not None
    for doc, summary in zip(docs, batch, strict=True):
        for pol, rep in ((0, 0), (0, 2), (1, 1)):
            got = document_view(reader, doc, pol, rep, summary=summary)
            assert got == document_view(reader, doc, pol, rep)
            assert got.branches and got.prompt_tokens > 0


def test_the_html_table_of_many_documents_holds_the_first_and_points_to_the_csv(
    tmp_path, monkeypatch
):
    """Beyond MAX_TABLE_DOCS documents the page's table holds the first ones and says where
    every document is; per_document.csv still has them all."""
    from kvcouple.analysis import analyze, text_html, write_report
    from text_helpers import synthetic_text_store

    monkeypatch.setattr(text_html, "MAX_TABLE_DOCS", 7)
    store = synthetic_text_store(tmp_path / "s.zarr", docs=12)
    out = write_report(analyze(store, n_boot=20, seed=0), tmp_path / "r", figures=False)
    page = (out / "report.html").read_text()
    table = page.split('<table class="sortable">', 1)[1].split("</table>", 1)[0]
    assert table.count("<tr>") == 1 + 7 * 3
    assert (
        "The first 7 of 12 documents' estimates (every document's are in per_document.csv)" in page
    )
    rows = (out / "per_document.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 12 * 3


def test_the_per_document_table_shows_each_documents_path_kld_and_same_top(tmp_path):
    """The KLD and same-top columns are each document's means over its path steps (kept by
    the scoreboard when the analysis folds the documents), not n/a: the same numbers as the
    document's own doc_scores."""
    import numpy as np

    from kvcouple.analysis import analyze, text_html, write_report
    from kvcouple.analysis.reading import SUMMARY_READ
    from kvcouple.analysis.scoreboard import doc_scores
    from kvcouple.analysis.tasks import AGREEMENT
    from kvcouple.store.reader import TraceStoreReader
    from text_helpers import synthetic_text_store

    store = synthetic_text_store(tmp_path / "s.zarr", docs=4)
    result = analyze(store, n_boot=20, seed=0)
    m = result.models[0]
    reader = TraceStoreReader(store)
    estimates = text_html._estimates(result, m, {})
    for i, d in enumerate(m.docs):
        summary = reader.read_summary(d.doc, (*SUMMARY_READ, AGREEMENT))
        for pol, s in doc_scores(reader, d.doc, summary).items():
            k = m.policies.index(pol)
            assert estimates["kl_pq"][i, k] == pytest.approx(float(s.kl.mean()), rel=1e-12)
            agree = float(np.mean(s.agree))
            assert estimates["same_top"][i, k] == pytest.approx(agree, rel=1e-12)
    page = (write_report(result, tmp_path / "r", figures=False) / "report.html").read_text()
    table = page.split('<table class="sortable">', 1)[1].split("</table>", 1)[0]
    cells = re.findall(r"<tr><td>.*?</tr>", table)
    assert cells and all(c.count("n/a") == 0 for c in cells)
