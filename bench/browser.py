"""Headless Chromium from Debian's packages (chromium, chromium-driver), driven with selenium.

Selenium is given both binaries, so it never runs Selenium Manager (which would try to download a browser). The
browser runs with everything that would reach the internet turned off: nodes (and CI) may have none.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

FLAGS = [
    "--headless",
    "--disable-gpu",
    "--no-sandbox",  # CI runs as root, where Chromium's sandbox can't start
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--window-size=1400,900",
]


def missing() -> str | None:
    """None when a headless Chromium can be driven here, else what to install (the browser tests skip with it)."""
    if (shutil.which("chromium") or shutil.which("chromium-browser")) and shutil.which("chromedriver"):
        return None
    return (
        "the browser tests need Debian's chromium and chromium-driver packages "
        "(apt-get install chromium chromium-driver; .ci/run installs them)"
    )


def find_chromium() -> tuple[str, str]:
    if reason := missing():
        raise RuntimeError(reason)
    return shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")


@contextmanager
def chromium() -> Iterator[webdriver.Chrome]:
    browser, driver_path = find_chromium()
    with tempfile.TemporaryDirectory(prefix="exo-chromium-") as profile:
        options = Options()
        options.binary_location = browser
        for flag in FLAGS + [f"--user-data-dir={profile}"]:
            options.add_argument(flag)
        driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
        try:
            yield driver
        finally:
            driver.quit()
