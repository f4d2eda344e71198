"""The committed gRPC stubs in node/grpc/generated/ are exactly what grpc_tools generates from
proto/node_service.proto (none is stale). To regenerate them, from the repository root:

    uv run python -m grpc_tools.protoc -Inode/grpc/generated=proto --python_out=. --grpc_python_out=. \
        --pyi_out=. proto/node_service.proto
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ["node_service_pb2.py", "node_service_pb2.pyi", "node_service_pb2_grpc.py"]
PACKAGE = "node/grpc/generated"  # where the stubs live; recorded in them (imports, descriptor name)


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("protoc")
    (work / "proto").mkdir()
    shutil.copy(ROOT / "proto" / "node_service.proto", work / "proto" / "node_service.proto")
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PACKAGE}=proto",
        "--python_out=.",
        "--grpc_python_out=.",
        "--pyi_out=.",
    ]
    done = subprocess.run([*cmd, "proto/node_service.proto"], cwd=work, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return work / PACKAGE


@pytest.mark.parametrize("name", GENERATED)
def test_committed_stub_matches_regenerated(regenerated, name):
    committed = (ROOT / PACKAGE / name).read_bytes()
    assert (regenerated / name).read_bytes() == committed, (
        f"{PACKAGE}/{name} is stale: regenerate it with the command in tests/unit/test_proto_stubs.py's docstring"
    )


def test_no_top_level_proto_package():
    """`proto` is proto-plus's import name (every google-cloud client installs it): we must not ship one."""
    assert not (ROOT / "proto" / "__init__.py").exists()
    assert not list((ROOT / "proto").glob("*.py"))
