"""The built documentation site and a generated report, opened in a real headless browser
(Debian's chromium through selenium) at 1280 px: every page loads, every figure decodes to a
non-empty image, no notebook page shows an error cell, no page is wider than the window, the
report's tables fit the page (each in its own box that scrolls if it must), and the API
reference documents every public function it promises.

The site tests run after ``make docs`` (CI: ``make docs docs-test``); the report test needs no
site. Skipped with a message where the site is not built or chromium/chromedriver/selenium are
absent.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from browser_helpers import headless_chrome, no_browser

SITE = Path(os.environ.get("KVCOUPLE_DOCS_SITE", Path(__file__).parents[2] / "build" / "site"))
pytestmark = no_browser
needs_site = pytest.mark.skipif(
    not (SITE / "index.html").exists(), reason=f"no built site at {SITE}: run `make docs`"
)
WIDTH = 1280

PAGES = sorted(SITE.rglob("index.html")) if SITE.exists() else []


@pytest.fixture(scope="module")
def browser():
    yield from headless_chrome(WIDTH)


IMAGES = """
return Array.from(document.images).map(i => [i.currentSrc.slice(0, 80), i.complete,
    i.naturalWidth, i.naturalHeight]);
"""
# nbconvert's templates mark error outputs; a traceback's text is the fallback.
ERRORS = """
const bad = document.querySelectorAll(
  '[data-mime-type="application/vnd.jupyter.error"], .output_error, .jp-OutputArea-output.jp-mod-error');
const text = document.body.innerText;
return [bad.length, text.includes('Traceback (most recent call last)')];
"""


# Horizontal overflow: the page wider than the window, and every table wider than the box
# it sits in (scrolled there) or running past the page's content edge.
OVERFLOW = """
const root = document.documentElement;
const page = [root.scrollWidth, root.clientWidth];
const body = document.body.getBoundingClientRect();
const tables = Array.from(document.querySelectorAll('table')).map((t, i) => {
  const box = t.parentElement;
  const r = box.getBoundingClientRect();
  const head = (t.rows.length ? t.rows[0].innerText : '').slice(0, 60);
  return [i, head, t.scrollWidth, box.clientWidth, Math.round(r.right), Math.round(body.right),
          getComputedStyle(box).overflowX];
});
return [page, tables];
"""


def _open(browser, page: Path) -> None:
    browser.get(page.as_uri())
    title = browser.title
    assert title and "404" not in title, (page, title)


def _overflow(browser) -> tuple[list[int], list[list]]:
    return browser.execute_script(OVERFLOW)


@needs_site
def test_the_site_has_the_pages_it_promises():
    names = {p.parent.relative_to(SITE).as_posix() for p in PAGES}
    for want in (".", "reference/api", "reference/cli", "SPEC", "tracer", "store"):
        assert want in names, sorted(names)
    notebooks = [n for n in names if n.startswith("notebooks/")]
    assert len(notebooks) == len(list((SITE.parent.parent / "notebooks").glob("*.ipynb"))) or (
        len(notebooks) >= 2
    ), notebooks


@needs_site
@pytest.mark.parametrize("page", PAGES, ids=[str(p.parent.relative_to(SITE)) for p in PAGES])
def test_every_page_loads_its_figures_and_shows_no_error(browser, page: Path):
    _open(browser, page)
    images = browser.execute_script(IMAGES)
    broken = [i for i in images if not i[1] or i[2] == 0 or i[3] == 0]
    assert not broken, f"{page}: images that did not load: {broken}"
    n_errors, traceback = browser.execute_script(ERRORS)
    assert n_errors == 0 and not traceback, f"{page}: an error cell is shown"
    (scroll, client), _ = _overflow(browser)
    assert scroll <= client, f"{page}: {scroll} px wide in a {client} px window"
    if "notebooks" in page.parts:
        # Executed notebooks carry their outputs: code, text and (for these) figures.
        assert browser.execute_script("return document.querySelectorAll('pre').length") > 3
        assert images, f"{page}: an executed tutorial without a single figure"


@needs_site
def test_the_api_reference_documents_the_public_functions(browser):
    _open(browser, SITE / "reference" / "api" / "index.html")
    ids = set(
        browser.execute_script(
            "return Array.from(document.querySelectorAll('[id]')).map(e => e.id)"
        )
    )
    for name in (
        "kvcouple.divergences",
        "kvcouple.couple",
        "kvcouple.analysis.analyze",
        "kvcouple.tracer.run.trace",
        "kvcouple.tracer.onestep.first_step",
        "kvcouple.models.load_model",
        "kvcouple.synth.exact",
    ):
        assert name in ids, f"{name} is missing from the API reference"
    text = browser.execute_script("return document.body.innerText")
    assert "Parameters" in text and "Returns" in text
    assert "kvcouple.decoding" not in text  # a module that does not exist


# Four policies with long specs (six pairs), as stored: every parameter spelled out; two
MATHS = """
return [document.querySelectorAll('.MathJax, .MathJax_Display').length,
        Array.from(document.scripts).map(s => s.src).filter(s => s.includes('MathJax'))];
"""


@needs_site
def test_notebook_maths_is_rendered_by_the_bundled_mathjax(browser):
    """A tutorial's $...$ maths is typeset, by the MathJax the site bundles (no CDN)."""
    import time

    _open(browser, SITE / "notebooks" / "01_coupling_on_toy_kernels" / "index.html")
    for _ in range(60):
        typeset, sources = browser.execute_script(MATHS)
        if typeset:
            break
        time.sleep(0.5)
    assert typeset >= 10, "the notebook's maths is not typeset"
    assert sources and all(s.startswith("file:") for s in sources), sources
    assert (SITE / "assets" / "mathjax" / "MathJax.js").is_file()


# models, a plan's tests and gaps pooled across the models: every kind of table the report has.
REPORT_POLICIES = {
    "snapkv:retain=0.5,window=32,kernel=7,pool=avg": 0.7,
    "snapkv:budget=64,window=32,kernel=7,pool=avg": 0.5,
    "recent:retain=0.5": 0.4,
    "streaming:retain=0.25,sinks=4": 0.3,
}
REPORT_PLAN = """
name = "width check"
estimator = "indicator"
n_boot = 100
seed = 1
pool_models = true

[documents]
split = { exploratory_fraction = 0.25, seed = 1 }

[[comparisons]]
name = "late-window branch TV exceeds early-window TV (SnapKV 50%)"
metric = "late_minus_early_tv"
policy = "snapkv:retain=0.5,window=32,kernel=7,pool=avg"
direction = "greater"

[[comparisons]]
name = "SnapKV 50% loses fewer tokens than recent 50%"
metric = "mismatch_fraction"
a = "recent:retain=0.5"
b = "snapkv:retain=0.5,window=32,kernel=7,pool=avg"
direction = "less"
"""


@pytest.fixture(scope="module")
def report_page(tmp_path_factory) -> Path:
    pytest.importorskip("matplotlib")
    from kvcouple import synth
    from kvcouple.analysis import analyze, load_plan, write_report
    from kvcouple.synth.trace_store import write_synthetic_trace_store

    tmp = tmp_path_factory.mktemp("report-width")
    stores = []
    for model, seed in (("llama-3.1-8b-instruct", 2), ("qwen2.5-7b-instruct", 3)):
        pairs = {
            spec: synth.random_pair(5, 5, seed=seed, closeness=c)
            for spec, c in REPORT_POLICIES.items()
        }
        stores.append(
            write_synthetic_trace_store(
                tmp / f"{model}.zarr",
                pairs,
                horizon=12,
                window=4,
                replicates=8,
                docs=12,
                seed=0,
                model_id=model,
            )  # fmt: skip
        )
    (tmp / "plan.toml").write_text(REPORT_PLAN)
    plan = load_plan(tmp / "plan.toml")
    result = analyze(stores, plan=plan, doc_set="confirmatory", allow_unregistered=True)
    assert result.tests  # the tests table is in the report
    return write_report(result, tmp / "report") / "report.html"


def test_report_tables_fit_a_1280px_page(browser, report_page: Path):
    """No table runs off the page at 1280 px, and these (the decomposition, the paired
    differences, the gap attribution, the survival comparisons) fit without scrolling: short
    labels, no constant columns, intervals wrapping under their estimates."""
    _open(browser, report_page)
    (scroll, client), tables = _overflow(browser)
    assert scroll <= client, f"the report is {scroll} px wide in a {client} px window"
    heads = [t[1] for t in tables]
    for want in (
        "label",
        "quantity",
        "B vs A\tgap",
        "B vs A\tE[M]/T",
        "B vs A\tRMST",
        "comparison",
    ):
        assert any(h.startswith(want) for h in heads), (want, heads)
    for i, head, width, box, right, page_right, overflow_x in tables:
        assert overflow_x == "auto", (i, head, "a table outside its scrolling box")
        assert right <= page_right + 1, (i, head, f"its box ends at {right} px, past {page_right}")
        assert width <= box, (i, head, f"{width} px wide in a {box} px box")


def test_the_width_check_can_fail(browser, tmp_path):
    """The same measurement flags a page whose table is wider than the window."""
    page = tmp_path / "wide.html"
    cells = "".join(f"<td>{'x' * 40}</td>" for _ in range(12))
    page.write_text(
        "<!DOCTYPE html><html><head><title>wide</title><style>td{white-space:nowrap}</style>"
        f"</head><body><div><table><tr>{cells}</tr></table></div></body></html>"
    )
    _open(browser, page)
    (scroll, client), tables = _overflow(browser)
    assert scroll > client
    assert tables[0][2] > tables[0][3] or tables[0][4] > tables[0][5]
