"""Fixtures of the network-namespace tests."""

import pytest

from node.security import write_key_file


@pytest.fixture(scope="module")
def key(tmp_path_factory):
    """A cluster key file the hosts share."""
    path = tmp_path_factory.mktemp("key") / "cluster.key"
    write_key_file(path)
    return path
