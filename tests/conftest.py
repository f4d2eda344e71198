"""Fixtures shared by every tier, and the tiers' markers.

tests/unit       fast, in process                      (no marker: `pytest -m "not slow"` runs exactly these)
tests/engines    numerics against references           slow, engines
tests/cluster    real node processes on loopback       slow, cluster
tests/multihost  network namespaces, needs root        slow, root
tests/web        a headless browser                    slow, browser
tests/install    pip (not uv) installs the built wheel  slow, install
"""

from pathlib import Path

import pytest

from tests.support.http import API_KEY
from tests.support.models import FIXTURES, MODELS, golden

__all__ = ["API_KEY", "FIXTURES", "MODELS", "golden"]  # (tests written before tests/support/ import them from here)

TIER_MARKERS = {
    "engines": ("slow", "engines"),
    "cluster": ("slow", "cluster"),
    "multihost": ("slow", "root"),
    "web": ("slow", "browser"),
    "install": ("slow", "install"),
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
