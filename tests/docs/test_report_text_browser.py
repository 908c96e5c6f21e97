"""The report's text views and per-document table in a real headless browser (Debian's
chromium through selenium, as the docs site is checked) at 1400 px: the views render with P
and Q side by side, the table sorts by a click and its links open their views, nothing runs
off the page, and hostile document ids and text (markup, control characters) show as text,
run no script. A screenshot is saved (``$KVCOUPLE_SCREENSHOTS``, else the test's folder).
Skipped with a message where chromium, chromedriver or selenium is absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from browser_helpers import headless_chrome, no_browser

WIDTH = 1400

pytestmark = [pytest.mark.torch, no_browser]


@pytest.fixture(scope="module")
def browser():
    yield from headless_chrome(WIDTH)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvcouple.analysis import analyze, write_report
    from text_helpers import cached_text_store

    tmp = tmp_path_factory.mktemp("report-text")
    store = cached_text_store("summary")
    return write_report(analyze(store, n_boot=20, seed=0), tmp / "r", figures=False)


STATE = """
const root = document.documentElement, body = document.body.getBoundingClientRect();
const views = Array.from(document.querySelectorAll('.tv-view')).filter(v => v.offsetParent);
const sides = Array.from(document.querySelectorAll('.tv-sides')).filter(v => v.offsetParent)
  .map(s => Array.from(s.children).map(c => Math.round(c.getBoundingClientRect().left)));
const wide = Array.from(document.querySelectorAll('.tv-view, .table-box'))
  .filter(e => e.offsetParent && e.getBoundingClientRect().right > body.right + 1).length;
return [root.scrollWidth, root.clientWidth, views.length, sides, wide,
        document.scripts.length, window.__pwned === undefined];
"""


def test_the_text_views_and_the_table_render_and_stay_escaped(browser, report: Path, tmp_path):
    from selenium.webdriver.common.by import By

    from text_helpers import DOCS, POLICIES

    browser.get((report / "report.html").as_uri())
    heading = browser.find_element(By.XPATH, "//h2[text()='What diverged']")
    assert heading.is_displayed()
    scroll, client, views, sides, wide, scripts, clean = browser.execute_script(STATE)
    assert scroll <= client and wide == 0, f"{scroll} px wide in {client} px; {wide} boxes over"
    assert views >= 2 * len(POLICIES)  # earliest and latest, per policy
    assert sides and all(len(s) == 2 and s[0] < s[1] for s in sides)  # P left of Q
    assert scripts == 1 and clean  # only the report's own script; nothing injected ran
    body = browser.find_element(By.TAG_NAME, "body").text
    assert "<script>alert('id')</script>" in body  # the hostile id, shown as text
    assert "esc\\x1b[31mred" in body and "\x1b" not in body
    browser.execute_script("arguments[0].scrollIntoView()", heading)
    shot = Path(os.environ.get("KVCOUPLE_SCREENSHOTS", tmp_path)) / "report-text.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    # The table: a row per document and policy; a click on a head sorts by it.
    table = browser.find_element(By.CSS_SELECTOR, "table.sortable")
    rows = table.find_elements(By.CSS_SELECTOR, "tbody tr")
    assert len(rows) == len(DOCS) * len(POLICIES)
    head = table.find_elements(By.TAG_NAME, "th")[3]  # mean time to divergence

    def column():
        cells = table.find_elements(By.CSS_SELECTOR, "tbody tr td:nth-child(4)")
        return [float(c.get_attribute("data-v")) for c in cells]

    head.click()
    assert column() == sorted(column())
    head.click()
    assert column() == sorted(column(), reverse=True)
    # A document's link opens its folded view.
    link = table.find_element(By.CSS_SELECTOR, "tbody a")
    target = link.get_attribute("href").split("#", 1)[1]
    link.click()
    view = browser.find_element(By.ID, target)
    assert view.get_attribute("open") is not None
    assert view.find_elements(By.CSS_SELECTOR, ".tv-sides")[0].is_displayed()
