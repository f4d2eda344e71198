"""The README's commands and examples work exactly as written."""

import json
import re
import subprocess
import sys
import textwrap

import pytest

from tests.support.cluster import READY_API, ROOT

README = (ROOT / "README.md").read_text()


def block(name: str) -> str:
    m = re.search(rf"<!-- example:{name} -->\n```\w+\n(.*?)```", README, re.S)
    assert m, f"README has no {name} example"
    return m.group(1)


def test_readme_commands():
    """CI runs the README's test command: in stages (fast tier first) that together select every test, the GPU
    tier last, on lavapipe, after the README's command builds the Vulkan backend."""
    assert "pip install uv && uv run --locked pytest" in README
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert 'pip install uv && uv run --locked pytest -m "not slow"' in ci
    assert 'uv run --locked pytest -m "slow and not gpu"' in ci
    assert "  uv run --locked pytest -m gpu" in ci
    assert '  uv run --locked exo-node build-backend vulkan --debian-headers --jobs "$(nproc)"' in ci
    assert 'if [ "${EXO_CI_VULKAN:-1}" = 1 ]; then' in ci  # on unless told


@pytest.fixture(scope="module")
def default_node():
    """The README's run command (default ports), minus the install step."""
    run = re.search(r"pip install uv && uv run --locked (exo-node[^\n]*)", README).group(1).split()
    proc = subprocess.Popen(
        [sys.executable, "-m", "node.cli", *run[1:], "--grpc-port", "0", "--discovery", "none"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in proc.stdout:
            if READY_API.search(line):
                break
        else:
            pytest.fail("node did not start (is port 52415 taken?)")
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_curl_example(default_node):
    out = subprocess.run(["sh", "-c", block("curl")], capture_output=True, text=True, timeout=60)
    assert '"object": "chat.completion"' in out.stdout, out.stdout + out.stderr


def test_python_example(default_node):
    out = subprocess.run([sys.executable, "-c", block("python")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr


def test_the_first_run_answer_is_the_one_the_readme_shows(default_node):
    section = README.split("## First run\n")[1].split("\n## ")[0]
    command = re.search(r"\n((?:    .*\n)+)\nanswers:", section).group(1)
    answer = section.split("\nanswers:")[1]
    shown = json.loads('"' + re.search(r'"content": "((?:[^"\\]|\\.)*)"', answer).group(1) + '"')
    out = subprocess.run(["sh", "-c", textwrap.dedent(command)], capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout)["choices"][0]["message"]["content"] == shown, out.stdout + out.stderr


@pytest.mark.parametrize("name", ["tools", "structured", "ollama", "anthropic", "responses"])
def test_tools_and_structured_output_examples(default_node, name):
    out = subprocess.run([sys.executable, "-c", block(name)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr
