"""Gemma served by three real nodes on loopback answers exactly as one process holding the whole model: sliding-window
layers and global ones split across nodes (tests/fixtures/make_gemma_reference.py's tiny random models)."""

import pytest

from shards.engines.registry import installed
from tests.cluster.test_moe_cluster import answer, reference
from tests.support.cluster import Cluster
from tests.support.models import FIXTURES

GEMMA = FIXTURES / "gemma"


@pytest.mark.skipif("ggml" not in installed(), reason="the ggml extra is not installed")
def test_three_pinned_ggml_nodes_on_a_gemma3_gguf_equal_one_process():
    """Layers 0-1 and 2-3 slide only, 4-5 hold the global layer too: each node's window masks and local rotary."""
    model = GEMMA / "gemma3.gguf"
    with Cluster(model, 3, shards=["0:2", "2:4", "4:6"], engine="ggml", model_id="gemma3") as c:
        assert answer(c, 24) == reference(model, "ggml", 24)  # 24 tokens: far past the window of 5


def test_three_automatic_numpy_nodes_on_a_gemma2_folder_equal_one_process():
    model = GEMMA / "gemma2"
    with Cluster(model, 3, memory_gb=[2, 2, 2]) as c:
        assert answer(c, 24) == reference(model, "numpy", 24)
