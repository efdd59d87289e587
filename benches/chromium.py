"""Debian's Chromium, headless, through Selenium and Debian's chromedriver: no browser download.

Used by the operator page's browser tests (``tests/http_and_cli/test_ui_browser.py``) and its screenshots
(``benches/house/ui_screenshots.py``). :func:`missing` says why a browser cannot be driven here
(``.ci/setup`` installs ``chromium`` and ``chromium-driver``); :func:`open_chromium` starts one
with a fresh profile, isolated from the network but for the server under test.
"""

from __future__ import annotations

import base64
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

__all__ = ["CHROMIUM", "CHROMEDRIVER", "missing", "open_chromium", "set_viewport", "full_page_png"]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--disable-extensions", "--hide-scrollbars", "--mute-audio",
)
"""How Chromium is started (with ``--user-data-dir`` of a fresh folder)."""


def missing() -> str | None:
    """Why a browser cannot be driven here (None: it can)."""
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (pip install -e '.[dev]')"
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            return f"{path} not found: install Debian's {package} (apt-get install chromium chromium-driver)"
    return None


@contextmanager
def open_chromium(*, width: int = 1280, height: int = 900) -> Iterator[WebDriver]:
    """A headless Chromium with a fresh profile, closed (and its profile removed) on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="kvmem-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.add_argument(f"--window-size={width},{height}")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.set_script_timeout(30)
        set_viewport(driver, width, height)
        yield driver
    finally:
        try:
            driver.quit()
        finally:
            shutil.rmtree(profile, ignore_errors=True)


def set_viewport(driver: WebDriver, width: int, height: int) -> None:
    """Make the page's viewport exactly ``width`` × ``height`` CSS pixels (device scale 1)."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})


def full_page_png(driver: WebDriver, path: Path, *, width: int) -> None:
    """Save a screenshot of the whole page at ``width`` CSS pixels (as tall as the page) to ``path``."""
    set_viewport(driver, width, 900)
    height = int(driver.execute_script("return Math.ceil(document.documentElement.scrollHeight)"))
    set_viewport(driver, width, height)
    shot: dict[str, Any] = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png"})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(shot["data"]))
