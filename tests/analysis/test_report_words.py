"""The words of the demo, the terminal table and the report (issue 19): one rule for numbers,
every symbol defined where it appears, every policy's full spec once, exploratory runs said
as such, shares above 100% explained, figure legends that name only what is drawn and cover
nothing."""

from __future__ import annotations

import pytest

from kvcouple import synth
from kvcouple.analysis import analyze, write_report
from kvcouple.analysis.console import format_decomposition, run_stamp
from kvcouple.analysis.labels import number, percent
from kvcouple.analysis.report_words import _share_note, compact_table
from kvcouple.analysis.tables import tidy_tables
from kvcouple.synth.trace_store import write_synthetic_trace_store

SNAP = "snapkv:retain=0.5,window=32,kernel=7,pool=avg"
RECENT = "recent:retain=0.5"


def test_numbers_have_three_significant_figures():
    cases = {
        0.60504: "0.605",
        0.72394: "0.724",
        0.018912: "0.0189",
        0.68: "0.680",
        1.0: "1.00",
        32.0: "32.0",
        -0.012345: "-0.0123",
        0.0: "0",
        999.7: "1000",
        12345.6: "12346",
    }
    for value, text in cases.items():
        assert number(value) == text, value
    assert number(4.0, integer=True) == "4"
    assert percent(1.0317) == "103%" and percent(0.605) == "60.5%"
    assert number(float("nan")) == "nan"


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("words")
    pairs = {
        SNAP: synth.random_pair(5, 5, seed=2, closeness=0.7),
        RECENT: synth.random_pair(5, 5, seed=2, closeness=0.4),
    }
    kw = {"horizon": 10, "replicates": 8, "branches": 1, "docs": 6, "seed": 0}
    full = write_synthetic_trace_store(tmp / "full.zarr", pairs, window=None, **kw)
    short = write_synthetic_trace_store(tmp / "short.zarr", pairs, window=3, **kw)
    return analyze(full, n_boot=100, seed=0), analyze(short, n_boot=100, seed=0), tmp


def test_the_terminal_table_defines_its_symbols_and_lists_every_policy(stores):
    full, short, _ = stores
    text = format_decomposition(full)
    lines = text.splitlines()
    assert lines[0].endswith(": 6 documents; T = 10 tokens generated per trajectory,")
    assert lines[1] == "  L = 9 lags traced after each first divergence (its branches)"
    legend = lines.index("policies (short label = full spec):")
    assert lines[legend + 1] == f"  snapkv:retain=0.5 = {SNAP}"
    assert lines[legend + 2] == f"  {RECENT.ljust(17)} = {RECENT}"
    assert text.index(SNAP) < text.index("occurrence P(tau<=T)")  # the specs come first
    assert "unobserved" not in text
    # Branches traced for 3 of 10 lags: rho unobserved, and the note says why.
    text = format_decomposition(short)
    assert "mismatch rate rho" in text and "unobserved" in text
    assert "so the mismatches after lag L are not seen and rho is unknown" in text
    assert "--window >= --horizon" in text
    assert run_stamp(full) == "exploratory (no plan)"


def test_the_report_says_exploratory_and_defines_the_gap_formula(stores):
    full, _, tmp = stores
    md = (write_report(full, tmp / "r", figures=False) / "report.md").read_text()
    assert "plan hash" not in md and "not preregistered: no plan" not in md
    assert "- **exploratory (no plan)**" in md
    assert "## Gap attribution\n" in md
    gap = md.split("## Gap attribution", 1)[1].split("\n## ", 1)[0]
    assert "m_B - m_A = df + rho_bar de + e_bar drho, where m = E[M]/T" in gap
    assert "It passes 100%" in gap
    row = next(x for x in gap.splitlines() if x.startswith("| recent:retain=0.5 vs snapkv"))
    assert len(row.split(" | ")) == 6  # the pair, then the five terms
    assert SNAP not in gap and "| model |" not in md  # short labels; one model: no column
    assert "L_w = 9 lags counted as observed by this analysis" in md
    assert "O-weighted (each replicate weighted by its probability O of diverging)" in md
    assert "early window: lags 1..s, late: lags s+1..L_w, with s = 4" in md
    assert "## Symbols" in md


def test_a_share_above_100_percent_is_explained():
    terms = {"delta_first_mismatch": {"estimate": -0.004}, "rate_term": {"estimate": -0.01}}
    note = _share_note({"estimate": 1.03, "ci_low": 0.68, "ci_high": 2.78}, terms)
    assert "go the other way" in note and number(-0.014) in note
    note = _share_note({"estimate": 0.8, "ci_low": 0.4, "ci_high": 1.3}, terms)
    assert "passes 100% or 0%" in note
    assert _share_note({"estimate": 0.8, "ci_low": 0.6, "ci_high": 0.9}, terms) == ""


def test_constant_columns_move_above_the_table():
    rows = [
        {"model": "m", "doc_id": "a", "reason": "unfinished"},
        {"model": "m", "doc_id": "b", "reason": "damaged"},
    ]
    text = compact_table(rows, ["model", "doc_id", "reason"])
    assert text.startswith("In every row: model: m.\n\n| doc_id | reason |")
    single = compact_table(rows[:1], ["model", "doc_id", "reason"])
    assert single.startswith("| model | doc_id | reason |")  # one row: nothing is constant


def _legend_texts(fig) -> list[str]:
    legend = fig.axes[0].get_legend()
    return [t.get_text() for t in legend.get_texts()]


def test_figure_legends_name_what_is_drawn_and_cover_nothing(stores):
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from kvcouple.analysis.figures import draw_figures

    full, short, _ = stores
    figs = draw_figures(tidy_tables(full))
    texts = _legend_texts(figs["decomposition"])
    assert not any("tail" in t for t in texts), texts  # to the horizon: no tail drawn
    assert any("lags 1..L_w" in t for t in texts)
    short_texts = _legend_texts(draw_figures(tidy_tables(short))["decomposition"])
    assert "unobserved tail (at most)" in short_texts
    for name in ("decomposition", "early_vs_late"):
        fig = figs[name]
        FigureCanvasAgg(fig).draw()
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        box = ax.get_legend().get_window_extent(renderer)
        plot = ax.get_window_extent(renderer)
        assert box.x0 >= plot.x1, (name, box, plot)  # beside the axes, over no bar
        assert box.x1 <= fig.bbox.x1 + 1, (name, "the legend is cut off")
