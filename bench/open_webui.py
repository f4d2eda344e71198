"""Open WebUI, driven in a real headless Chromium, chatting with a 2-node cluster: the model list, a streamed answer,
a second turn. Writes the picture in docs/open-webui.png.

    uv run python -m bench.open_webui --venv /tmp/owui-venv [--api ollama|openai] [--out docs/open-webui.png]

Open WebUI (PyPI `open-webui`) is large (torch, transformers, chromadb, ...), so it lives in a throwaway venv outside
the project, made here when missing: Python 3.11, torch first (a plain `torch` requirement would pull a multi-GB
CUDA build where a CPU one is at hand), then Open WebUI. It runs single-user (WEBUI_AUTH=False) in a temporary
DATA_DIR, with everything that would reach the internet or load a model of its own turned off, pointed at node0's
API: through Ollama's API (what it uses for local models) or, with --api openai, the OpenAI one.
Needs Debian's chromium and chromium-driver (as the browser tests do). Not CI: the install alone is gigabytes.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.wait import WebDriverWait

from bench.browser import chromium
from bench.local_cluster import ROOT, Cluster, free_port
from shards.formats.packaged import resolve_model

OPEN_WEBUI = "open-webui==0.12.4"  # the release this script was run against (its page's selectors are below)
TORCH = "torch==2.13.0"  # the CPU build on the machine; any torch Open WebUI accepts will do
QUESTIONS = ("What is the capital of France?", "And what is it famous for? Answer in one sentence.")
MAX_TOKENS = 96  # the nodes' cap per request: Open WebUI sends none, and short turns keep the run short
STARTUP_S = 600  # Open WebUI imports torch, transformers and chromadb: minutes on a busy machine
ANSWER_S = 300
THREADS = 1  # per node: the nodes, Open WebUI and Chromium share the machine
RERENDERED = (StaleElementReferenceException,)  # Svelte replaces elements as it renders: look again
LOG = Path(tempfile.gettempdir()) / "open-webui.log"

# Open WebUI's settings: one user, no login, nothing fetched from the internet, no model loaded in its own process,
# and no background generations (titles, tags, follow-ups) competing with the chat for the cluster.
QUIET = {
    "WEBUI_AUTH": "False",
    "OFFLINE_MODE": "True",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "ENABLE_VERSION_UPDATE_CHECK": "False",
    "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "False",
    "RAG_RERANKING_MODEL_AUTO_UPDATE": "False",
    "RAG_EMBEDDING_ENGINE": "ollama",  # not '' (a local sentence-transformers model, fetched from a hub)
    "BYPASS_EMBEDDING_AND_RETRIEVAL": "True",
    "ENABLE_TITLE_GENERATION": "False",
    "ENABLE_TAGS_GENERATION": "False",
    "ENABLE_FOLLOW_UP_GENERATION": "False",
    "ENABLE_AUTOCOMPLETE_GENERATION": "False",
    "ENABLE_RETRIEVAL_QUERY_GENERATION": "False",
    "ENABLE_SEARCH_QUERY_GENERATION": "False",
    # Open WebUI gives every model its built-in tools (memory, notes, chats, time, ...) by default: thousands of
    # prompt tokens of tool specs, which a small model can't use and a busy CPU prefills for minutes.
    "DEFAULT_MODEL_METADATA": '{"capabilities": {"builtin_tools": false}}',
    "SCARF_NO_ANALYTICS": "true",
    "DO_NOT_TRACK": "true",
    "ANONYMIZED_TELEMETRY": "false",
}


def connection(api: str, node_url: str) -> dict[str, str]:
    """The settings that point Open WebUI at a node: its Ollama connection, or its OpenAI one (the other off)."""
    if api == "ollama":
        return {"ENABLE_OLLAMA_API": "True", "OLLAMA_BASE_URL": node_url, "ENABLE_OPENAI_API": "False"}
    return {
        "ENABLE_OLLAMA_API": "False",
        "ENABLE_OPENAI_API": "True",
        "OPENAI_API_BASE_URL": f"{node_url}/v1",
        "OPENAI_API_KEY": "not-needed",
    }


def install(venv: Path) -> Path:
    """venv/bin/open-webui, installing it first when missing."""
    exe = venv / "bin" / "open-webui"
    if exe.exists():
        return exe
    python = shutil.which("python3.11")
    if python is None:
        raise RuntimeError("Open WebUI needs Python 3.11 or 3.12 to make its venv: install python3.11")
    if not (venv / "bin" / "pip").exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "pip"), "install", "--quiet"]
    subprocess.run([*pip, TORCH], check=True)
    subprocess.run([*pip, OPEN_WEBUI], check=True)
    return exe


def wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"Open WebUI exited with {proc.returncode}; see {LOG}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"Open WebUI did not answer {url} within {timeout:.0f} s")
        time.sleep(1)


@contextmanager
def open_webui(exe: Path, env: dict[str, str]) -> Iterator[str]:
    """Open WebUI serving on loopback in a temporary DATA_DIR; yields its URL; always stopped."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="open-webui-") as data:
        env = {**os.environ, **QUIET, **env, "DATA_DIR": data, "WEBUI_SECRET_KEY": secrets.token_hex(32)}
        log = LOG.open("w")
        serve = [str(exe), "serve", "--host", "127.0.0.1", "--port", str(port)]
        proc = subprocess.Popen(serve, cwd=data, env=env, stdout=log, stderr=subprocess.STDOUT)
        print(f"Open WebUI starting on port {port} (log: {LOG})", flush=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(f"{url}/health", proc, STARTUP_S)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


class PatientCluster(Cluster):
    """The launcher with minutes, not seconds, to start: Open WebUI's install and start compete for the CPU."""

    def _wait_ready(self, node, timeout: float = STARTUP_S) -> None:
        super()._wait_ready(node, timeout)

    def wait_for_peers(self, timeout: float = STARTUP_S) -> None:
        super().wait_for_peers(timeout)


# -- the page ---------------------------------------------------------------------------------------------------
def dismiss_dialogs(driver: WebDriver) -> None:
    """Close the release notes Open WebUI shows a new user ("Okay, Let's Go!")."""
    for button in driver.find_elements(By.XPATH, '//button[contains(., "Let\'s Go")]'):
        if button.is_displayed():
            button.click()


def pick_model(driver: WebDriver, wait: WebDriverWait, model_id: str) -> None:
    """Open the model list, check the cluster's model is in it, and choose it."""
    selector = "[id^='model-selector-'][id$='-button']"
    button = wait.until(lambda d: next(iter(d.find_elements(By.CSS_SELECTOR, selector)), None))
    button.click()
    choices = "[role='option'], [role='menuitem'], button"
    item = wait.until(
        lambda d: next(
            (
                e
                for e in d.find_elements(By.CSS_SELECTOR, choices)
                if e != button and model_id in e.text and e.is_displayed()
            ),
            None,
        )
    )
    item.click()
    wait.until(lambda d: model_id in d.find_element(By.CSS_SELECTOR, selector).text)


def answers(driver: WebDriver) -> list[str]:
    return [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#response-content-container")]


def ask(driver: WebDriver, wait: WebDriverWait, question: str, turn: int) -> tuple[str, int]:
    """Send one question; wait for its answer to stream in and finish. Returns the answer and how many distinct
    partial texts the page showed on the way (a streamed answer shows several)."""
    box = wait.until(lambda d: d.find_element(By.ID, "chat-input"))
    box.click()
    box.send_keys(question)
    box.send_keys(Keys.ENTER)
    seen: set[str] = set()

    def finished(d: WebDriver) -> bool:
        texts = answers(d)
        if len(texts) < turn:
            return False
        seen.add(texts[turn - 1])
        done = d.find_elements(By.CSS_SELECTOR, ".copy-response-button")  # a message's buttons: once it is done
        return bool(texts[turn - 1].strip()) and len(done) >= turn

    WebDriverWait(driver, ANSWER_S, poll_frequency=0.05, ignored_exceptions=RERENDERED).until(finished)
    return answers(driver)[turn - 1], len(seen - {""})


def chat(driver: WebDriver, url: str, model_id: str, out: Path) -> list[str]:
    driver.set_window_size(1280, 800)
    driver.get(url)
    wait = WebDriverWait(driver, 120, poll_frequency=0.2, ignored_exceptions=RERENDERED)
    wait.until(lambda d: d.find_elements(By.ID, "chat-input"))
    time.sleep(1)
    dismiss_dialogs(driver)
    pick_model(driver, wait, model_id)
    said = []
    for turn, question in enumerate(QUESTIONS, 1):
        text, partials = ask(driver, wait, question, turn)
        print(f"turn {turn}: {question!r} -> {text!r} ({partials} texts seen while streaming)")
        if partials < 2:
            raise RuntimeError(f"turn {turn}'s answer arrived whole, not streamed: {text!r}")
        said.append(text)
    page = driver.find_element(By.TAG_NAME, "body").text
    missing = [q for q in QUESTIONS + tuple(said) if q.strip() and q.strip().splitlines()[0] not in page]
    if missing:
        raise RuntimeError(f"the page does not show {missing}")
    out.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(out))
    return said


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=Path("/tmp/owui-venv"), help="Open WebUI's venv (made if missing)")
    ap.add_argument("--api", choices=("ollama", "openai"), default="ollama", help="the node API Open WebUI uses")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "open-webui.png")
    args = ap.parse_args()
    exe = install(args.venv)
    gguf, model_id = resolve_model("smollm2")
    with PatientCluster(
        gguf,
        2,
        model_id=model_id,
        engine=None,
        api_nodes=1,
        extra=["--max-tokens", str(MAX_TOKENS), "--threads", str(THREADS)],
    ) as c:
        node_url = c.nodes[0].api_url
        with open_webui(exe, connection(args.api, node_url)) as url, chromium() as driver:
            try:
                chat(driver, url, model_id, args.out)
            except Exception:
                debug = Path(tempfile.gettempdir()) / "open-webui-failure"
                debug.mkdir(exist_ok=True)
                driver.save_screenshot(str(debug / "page.png"))
                (debug / "page.html").write_text(driver.page_source)
                print(f"the page at the failure: {debug}/page.png, page.html")
                raise
    print("wrote", args.out)


if __name__ == "__main__":
    main()
