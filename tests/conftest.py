import json
from functools import cache
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = ["llama", "qwen2", "qwen3"]


@cache
def golden(model: str) -> dict:
    return json.loads((FIXTURES / model / "golden.json").read_text())


@pytest.fixture(params=MODELS)
def model(request) -> str:
    return request.param


@pytest.fixture
def model_dir(model) -> Path:
    return FIXTURES / model


API_KEY = "sk-test-key"


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
