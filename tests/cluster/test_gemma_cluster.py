"""Gemma served by three real nodes on loopback answers exactly as one process holding the whole model: sliding-window
layers and global ones split across nodes (tests/fixtures/make_gemma_reference.py's tiny random models)."""

from tests.cluster.test_moe_cluster import answer, reference
from tests.support.cluster import Cluster
from tests.support.models import FIXTURES

GEMMA = FIXTURES / "gemma"


def test_three_automatic_numpy_nodes_on_a_gemma2_folder_equal_one_process():
    model = GEMMA / "gemma2"
    with Cluster(model, 3, memory_gb=[2, 2, 2]) as c:
        assert answer(c, 24) == reference(model, "numpy", 24)
