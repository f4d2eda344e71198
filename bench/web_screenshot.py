"""The README's picture of the web page: a 3-node cluster serving the demo model, after one chat answer.

    uv run python -m bench.web_screenshot [--out docs/web-page.png]

Needs Debian's chromium and chromium-driver (as the browser tests do).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from selenium.webdriver.common.by import By
from selenium.webdriver.support.wait import WebDriverWait

from bench.browser import chromium
from bench.local_cluster import ROOT, Cluster
from node.cli import DEMO_MODEL

PROMPT = "And God said, Let there be"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "web-page.png")
    args = ap.parse_args()
    with Cluster(DEMO_MODEL, 3, memory_gb=[8, 4, 4]) as cluster, chromium() as driver:
        driver.set_window_size(1280, 760)
        driver.get(f"{cluster.nodes[0].api_url}/")
        wait = WebDriverWait(driver, 60, poll_frequency=0.05)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#nodes .node")) == 3)
        for field, value in (("#temperature", "0"), ("#max-tokens", "60"), ("#prompt", PROMPT)):
            element = driver.find_element(By.CSS_SELECTOR, field)
            element.clear()
            element.send_keys(value)
        driver.find_element(By.ID, "send").click()
        wait.until(
            lambda d: d.find_element(By.CSS_SELECTOR, ".message.assistant").get_attribute("data-state") == "done"
        )
        time.sleep(3)  # peers' counters reach the page through a health check: a poll or two later they're current
        args.out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(args.out))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
