"""The committed gRPC stubs are exactly what grpc_tools generates from proto/node_service.proto (none is stale)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ["node_service_pb2.py", "node_service_pb2.pyi", "node_service_pb2_grpc.py"]


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("protoc")
    # The same relative path as in the repository: it is recorded in the stubs (imports, descriptor name).
    (work / "proto").mkdir()
    shutil.copy(ROOT / "proto" / "node_service.proto", work / "proto" / "node_service.proto")
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--grpc_python_out=.", "--pyi_out=."]
    done = subprocess.run([*cmd, "proto/node_service.proto"], cwd=work, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return work / "proto"


@pytest.mark.parametrize("name", GENERATED)
def test_committed_stub_matches_regenerated(regenerated, name):
    committed = (ROOT / "proto" / name).read_bytes()
    assert (regenerated / name).read_bytes() == committed, (
        f"proto/{name} is stale: rerun grpc_tools.protoc from the repository root (see tests/test_proto_stubs.py)"
    )
