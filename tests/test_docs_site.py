"""The built documentation site, opened in a real headless browser (Debian's chromium through
selenium): every page loads, every figure decodes to a non-empty image, no notebook page shows
an error cell, and the API reference documents every public function it promises.

Runs after ``make docs`` (CI: ``make docs docs-test``); skipped with a message where the site
is not built or chromium/chromedriver/selenium are absent.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

SITE = Path(os.environ.get("KVCOUPLE_DOCS_SITE", Path(__file__).parent.parent / "build" / "site"))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.skipif(
        not (SITE / "index.html").exists(), reason=f"no built site at {SITE}: run `make docs`"
    ),
    pytest.mark.skipif(
        CHROMIUM is None or DRIVER is None,
        reason="headless browser test skipped: apt-get install chromium chromium-driver",
    ),
]

PAGES = sorted(SITE.rglob("index.html")) if SITE.exists() else []


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


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


def _open(browser, page: Path) -> None:
    browser.get(page.as_uri())
    title = browser.title
    assert title and "404" not in title, (page, title)


def test_the_site_has_the_pages_it_promises():
    names = {p.parent.relative_to(SITE).as_posix() for p in PAGES}
    for want in (".", "reference/api", "reference/cli", "SPEC", "tracer", "store"):
        assert want in names, sorted(names)
    notebooks = [n for n in names if n.startswith("notebooks/")]
    assert len(notebooks) == len(list((SITE.parent.parent / "notebooks").glob("*.ipynb"))) or (
        len(notebooks) >= 2
    ), notebooks


@pytest.mark.parametrize("page", PAGES, ids=[str(p.parent.relative_to(SITE)) for p in PAGES])
def test_every_page_loads_its_figures_and_shows_no_error(browser, page: Path):
    _open(browser, page)
    images = browser.execute_script(IMAGES)
    broken = [i for i in images if not i[1] or i[2] == 0 or i[3] == 0]
    assert not broken, f"{page}: images that did not load: {broken}"
    n_errors, traceback = browser.execute_script(ERRORS)
    assert n_errors == 0 and not traceback, f"{page}: an error cell is shown"
    if "notebooks" in page.parts:
        # Executed notebooks carry their outputs: code, text and (for these) figures.
        assert browser.execute_script("return document.querySelectorAll('pre').length") > 3
        assert images, f"{page}: an executed tutorial without a single figure"


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
