"""Headless chromium for the tests that open pages in a real browser (the docs site, the
report's text views): where the browser lives, the skip where it does not, one driver."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")

no_browser = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="headless browser test skipped: apt-get install chromium chromium-driver",
)


def headless_chrome(width: int) -> Iterator[Any]:
    """A headless chromium driver ``width`` pixels wide (yielded; quit afterwards)."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={width},1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()
