"""Playwright on Debian's Chromium for the admin tests. Never downloads a browser.

``/usr/bin/chromium`` comes from ``apt-get install chromium`` (``.ci/run`` does
it). Without it the browser tests are skipped, unless ``AWA_REQUIRE_BROWSER=1``
makes its absence a failure.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _unavailable(reason: str) -> None:
    if os.environ.get("AWA_REQUIRE_BROWSER") == "1":
        pytest.fail(f"AWA_REQUIRE_BROWSER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@contextmanager
def chromium() -> Iterator[Browser]:
    """A headless Chromium from ``/usr/bin/chromium``; skips (or fails) without one."""
    if not CHROMIUM.exists():
        _unavailable(f"{CHROMIUM} is missing (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is not installed")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()
