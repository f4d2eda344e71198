"""The web page, in a real headless Chromium, against a live 2-node cluster that requires an API key.

One browser session for the whole module. The model is a tiny random Llama with a 4096-token context, so a long
request really is still running when the stop button is pressed.
"""

from __future__ import annotations

import re

import pytest
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.wait import WebDriverWait

from bench.browser import chromium, missing
from bench.random_model import write_random_llama
from tests.support.cluster import Cluster
from tests.support.http import raw
from tests.support.metrics import scrape, value
from tests.support.models import FIXTURES

pytestmark = pytest.mark.skipif(missing() is not None, reason=missing() or "")

KEY = "sk-page-test"
TINY = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = write_random_llama(tmp_path_factory.mktemp("web") / "tiny", **TINY)
    with Cluster(model, 2, shards=["0:1", "1:4"], api_key=KEY, extra=["--max-tokens", "4000"]) as c:
        yield c


class Page:
    """What a person sees and does on the page."""

    def __init__(self, driver):
        self.driver = driver

    def wait(self, condition, timeout: float = 30):
        return WebDriverWait(self.driver, timeout, poll_frequency=0.05).until(lambda _: condition())

    def find(self, css: str):
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def visible(self, css: str) -> bool:
        try:
            found = self.driver.find_elements(By.CSS_SELECTOR, css)
            return bool(found) and found[0].is_displayed()
        except StaleElementReferenceException:  # re-rendered between the two calls: ask again
            return False

    def fill(self, css: str, value: str) -> None:
        field = self.find(css)
        field.clear()
        field.send_keys(value)

    def send(self, text: str, temperature: float, max_tokens: int) -> None:
        self.fill("#temperature", str(temperature))
        self.fill("#max-tokens", str(max_tokens))
        self.fill("#prompt", text)
        self.find("#send").click()

    def answer(self) -> dict:
        """The last assistant message: its exact text (not as rendered), state, finish reason, chunks received."""
        return self.driver.execute_script("""
            const all = document.querySelectorAll('.message.assistant');
            const m = all[all.length - 1];
            return m ? {text: m.querySelector('.text').textContent, state: m.dataset.state,
                        finish: m.dataset.finish, chunks: Number(m.dataset.chunks)} : null;""")

    def texts(self, css: str) -> list[str]:
        """The rendered text of every match, read in one script: the page re-renders its lists every second, so
        elements found in one call may be gone (stale) by the next."""
        return self.driver.execute_script(
            "return [...document.querySelectorAll(arguments[0])].map(e => e.innerText.trim())", css
        )

    def nodes(self) -> dict[str, str]:
        """Node id -> the layer range its card shows."""
        return dict(
            self.driver.execute_script(
                "return [...document.querySelectorAll('#nodes .node')].map(c => [c.dataset.nodeId, c.dataset.layers])"
            )
        )

    def field(self, node_id: str, label: str) -> str | None:
        """The value a node's card shows for `label` (None: no such card or field yet)."""
        return self.driver.execute_script(
            "const card = [...document.querySelectorAll('#nodes .node')].find(c => c.dataset.nodeId === arguments[0]);"
            "const dd = card && card.querySelector(`dd[data-field='${arguments[1]}']`);"
            "return dd ? dd.innerText.trim() : null",
            node_id,
            label,
        )

    def segments(self) -> list[str]:
        return self.texts("#layers .segment")

    def errors(self) -> list[str]:
        return self.texts(".message.error")


@pytest.fixture(scope="module")
def page(cluster):
    with chromium() as driver:
        driver.get(f"{cluster.nodes[0].api_url}/")
        page = Page(driver)
        page.wait(lambda: page.visible("#key-form"))  # the API refused the page's first calls: it asks for a key
        page.asked_for_key = True
        page.fill("#key-input", KEY)
        page.find("#key-form button").click()
        page.wait(lambda: not page.visible("#key-form"))
        yield page


def test_chat_streams_the_apis_greedy_answer_and_the_view_shows_both_nodes(cluster, page, tmp_path):
    assert page.asked_for_key
    page.wait(lambda: page.nodes() == {"node0": "0:1", "node1": "1:4"})
    assert page.segments() == ["node0 · 0", "node1 · 1–3"]  # the model's 4 layers, as two segments of a bar

    page.send("w5 w6 w7", temperature=0, max_tokens=24)
    page.wait(lambda: page.answer()["state"] != "streaming")
    shown = page.answer()
    status, body = cluster.chat("w5 w6 w7", max_tokens=24, temperature=0)
    assert status == 200, body
    assert shown["state"] == "done" and shown["finish"] == body["choices"][0]["finish_reason"]
    assert shown["text"] == body["choices"][0]["message"]["content"] and shown["text"]
    assert shown["chunks"] > 1  # it arrived as a stream, not in one piece
    assert page.errors() == []

    png = tmp_path / "page.png"
    assert page.driver.save_screenshot(str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_api_errors_are_shown_as_messages(page):
    page.find("#clear").click()
    page.send("w5", temperature=0, max_tokens=4050)  # within the context, above --max-tokens 4000
    page.wait(lambda: page.errors())
    assert "max_tokens may be at most 4000" in page.errors()[-1]


def test_stop_button_ends_the_request_on_every_node(cluster, page):
    page.find("#clear").click()
    page.send("w9", temperature=0, max_tokens=4000)
    page.wait(lambda: (a := page.answer()) is not None and len(a["text"]) > 0)  # streaming has begun
    assert all(n > 0 for n in cluster.active_requests().values())  # both nodes hold the request
    page.find("#stop-button").click()
    page.wait(lambda: page.answer()["state"] == "stopped")

    assert set(cluster.wait_idle().values()) == {0}
    for node_id, info in cluster.self_info().items():
        assert info["status"].get("ended_cancelled", 0) >= 1, node_id
    assert page.answer()["chunks"] < 4000  # it did not run to the end
    assert value(scrape(cluster.nodes[0].api_url, KEY), "exo_requests_total", endpoint="chat", outcome="cancelled") == 1
    assert page.find("#send").is_enabled() and not page.find("#stop-button").is_enabled()


def test_page_and_assets_need_no_key_but_the_api_does(cluster):
    base = cluster.nodes[0].api_url
    for path in ("/", "/static/app.js", "/static/style.css"):
        status, headers, _ = raw(base, "GET", path, timeout=10)
        assert status == 200 and "default-src 'none'" in headers["Content-Security-Policy"]
    for path in ("/v1/topology", "/metrics"):
        assert raw(base, "GET", path, timeout=10)[0] == 401


def test_the_page_loads_nothing_from_elsewhere():
    """No CDN, no external fonts or scripts: nodes may have no internet (the CSP header enforces it as well)."""
    from node.http.webui import WEB

    files = {p.name: p.read_text() for p in WEB.iterdir()}
    assert set(files) == {"index.html", "app.js", "style.css"}
    for name, text in files.items():
        assert "http://" not in text and "https://" not in text and "@import" not in text, name
        assert 'src="//' not in text and 'href="//' not in text and "url(" not in text, name


def test_a_peer_that_leaves_drops_out_of_the_view_with_an_event(cluster, page):
    """(The module's last browser test: it stops node1.)"""
    cluster.nodes[1].proc.terminate()
    cluster.nodes[1].proc.wait(timeout=15)
    page.wait(lambda: page.nodes() == {"node0": "0:1"})
    events = page.texts("#events li")
    assert events[0].endswith("node1 left") and events[-1].endswith("2 node(s): node0, node1")
    # node0 alone can't cover layers 1-3: the bar shows the gap and the view says why requests would fail
    page.wait(lambda: page.segments() == ["node0 · 0", "not covered · 1–3"])
    assert "layers 1-3 are not covered" in page.find("#cluster-error").text


def test_a_node_fetching_its_layers_shows_its_progress_then_the_layers_it_holds(tmp_path):
    """node1 starts with only the model's id and fetches its layers from node0, which uploads slowly (0.5 Mbit/s)
    so that the fetch lasts a few seconds; the page shows it going, then what node1 holds."""
    fetching = ["--model", "llama", "--models-dir", str(tmp_path / "node1"), "--wait-for-peers", "1"]
    with (
        Cluster(
            FIXTURES / "llama",
            2,
            per_node=[["--max-upload-mbps", "0.5"], fetching],
            model_id="llama",
            memory_gb=[1, 1],
        ) as c,
        chromium() as driver,
    ):
        driver.get(f"{c.nodes[0].api_url}/")
        page, seen = Page(driver), []

        def files_of_node1() -> str:
            seen.append(page.field("node1", "files"))
            return seen[-1]

        page.wait(lambda: (files_of_node1() or "").endswith("(fetched)"), timeout=60)
        assert page.field("node0", "files") == "whole model"
        assert any(re.fullmatch(r"fetching layers \d+-\d+: \d+%", s or "") for s in seen), sorted(set(map(str, seen)))
        plan = {s["node_id"]: (s["start"], s["end"]) for s in c.topology()["plan"]}
        start, end = plan["node1"]
        assert seen[-1] == f"layers {start}–{end - 1} (fetched)"
