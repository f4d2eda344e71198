"""Clusters shared by more than one module of the cluster tier: session-scoped, so started once whichever module asks
first (pytest groups the tests of each parameter, one instance at a time), and stopped right after the last test
that uses one rather than at the end of the tier, where idle nodes would only hold memory and CPU."""

from __future__ import annotations

import openai
import pytest

from tests.support.cluster import Cluster
from tests.support.gguf_util import smollm2_path
from tests.support.tool_schemas import MODEL

SHARED = "smollm2_client"
_running: dict[str, Cluster] = {}  # fixture name -> its live cluster


@pytest.fixture(scope="session", params=[1, 3], ids=["1-node", "3-nodes"])
def smollm2_client(request):
    """The official openai client on the packaged SmolLM2 (its default engine), served by one node or by three
    (layers 0:10 / 10:20 / 20:30): tools and structured output (test_api_tools.py, test_api_structured.py)."""
    shards = ["0:10", "10:20", "20:30"] if request.param == 3 else None
    with Cluster(smollm2_path(), request.param, shards=shards, model_id=MODEL, engine=None) as c:
        _running[SHARED] = c
        yield openai.OpenAI(base_url=f"{c.nodes[0].api_url}/v1", api_key="unused", max_retries=0)
        _running.pop(SHARED, None)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last test of the session that uses the shared cluster, stop its nodes (the fixture's own exit
    later finds them stopped)."""
    if SHARED not in _running or SHARED not in getattr(item, "fixturenames", ()):
        return
    items = item.session.items
    if not any(SHARED in getattr(later, "fixturenames", ()) for later in items[items.index(item) + 1 :]):
        _running.pop(SHARED).__exit__(None, None, None)
