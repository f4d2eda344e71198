"""Fixtures shared by every tier, and the tiers' markers.

tests/unit       fast, in process                      (no marker: `pytest -m "not slow"` runs exactly these)
tests/engines    numerics against references           slow, engines
tests/cluster    real node processes on loopback       slow, cluster
tests/multihost  network namespaces, needs root        slow, root
tests/web        a headless browser                    slow, browser
tests/install    pip (not uv) installs the built wheel  slow, install
tests/gpu        the ggml engine on a GPU backend's device  slow, gpu

A durations budget (.ci/run sets it): with PYTEST_DURATION_BUDGET_S the summary names every test whose setup + call
took longer (a module's cluster start counts in its first test's setup), and with EXO_SUITE_BUDGET_S it gives the
session's wall time against that budget. It names, it never fails a run: timings depend on the machine's load.
"""

import os
import time
from pathlib import Path

import pytest

from tests.support.http import API_KEY
from tests.support.models import FIXTURES, MODELS, golden

__all__ = ["API_KEY", "FIXTURES", "MODELS", "golden"]  # (tests written before tests/support/ import them from here)
_STARTED = pytest.StashKey[float]()

TIER_MARKERS = {
    "engines": ("slow", "engines"),
    "cluster": ("slow", "cluster"),
    "multihost": ("slow", "root"),
    "web": ("slow", "browser"),
    "install": ("slow", "install"),
    "gpu": ("slow", "gpu"),
}


def pytest_collection_modifyitems(config, items):
    """Mark each test by the tier folder it lives in, so that `-m` selects tiers without a decorator per file."""
    tests = Path(__file__).parent
    for item in items:
        path = Path(item.fspath)
        tier = path.relative_to(tests).parts[0] if path.is_relative_to(tests) else None
        for name in TIER_MARKERS.get(tier, ()):
            item.add_marker(name)


@pytest.fixture(params=MODELS)
def model(request) -> str:
    return request.param


@pytest.fixture
def model_dir(model) -> Path:
    return FIXTURES / model


@pytest.fixture(scope="session")
def single_api():
    """A live single node with an API key and CORS for one origin: (base url, key)."""
    from tests.support.cluster import Cluster

    with Cluster(FIXTURES / "llama", 1, api_key=API_KEY, extra=["--cors-origins", "http://app.example"]) as c:
        yield c.nodes[0].api_url, API_KEY


@pytest.fixture(scope="session")
def live_cluster():
    """A live 3-node cluster, layers pinned 0:2 / 2:4 / 4:6, an API on every node, no key."""
    from tests.support.cluster import Cluster

    with Cluster(FIXTURES / "llama", 3, shards=["0:2", "2:4", "4:6"]) as c:
        yield c


@pytest.fixture(scope="session")
def cluster_api(live_cluster):
    """live_cluster's entry node 0: (base url, key)."""
    return live_cluster.nodes[0].api_url, "unused"


_DURATIONS: dict[str, float] = {}  # nodeid -> seconds of setup + call


def pytest_configure(config):
    config.stash[_STARTED] = time.monotonic()  # before collection, which is part of what the suite costs


def pytest_runtest_logreport(report):
    if report.when in ("setup", "call"):
        _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration


@pytest.hookimpl(trylast=True)  # after the other summaries, whose time is the session's too
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The durations budget (see the module docstring): the tests over the per-test budget, slowest first, and
    the session against the suite's budget."""
    per_test, suite = os.environ.get("PYTEST_DURATION_BUDGET_S"), os.environ.get("EXO_SUITE_BUDGET_S")
    if per_test:
        over = sorted(((s, n) for n, s in _DURATIONS.items() if s > float(per_test)), reverse=True)
        terminalreporter.write_sep("=", f"{len(over)} tests over the {float(per_test):g} s budget (setup + call)")
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:8.1f} s  {nodeid}")
    if suite:
        took = time.monotonic() - config.stash[_STARTED]
        verdict = "over" if took > float(suite) else "within"
        terminalreporter.write_line(f"suite: {took:.0f} s of {float(suite):g} s budget ({verdict})")
