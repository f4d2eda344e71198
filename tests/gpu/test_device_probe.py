"""A node left to choose its device (`--device auto`, the default) loads a built GPU backend only when it would
compute on one of its devices: a child process lists them first (shards/engines/ggml/device_probe.py), so a machine
whose backend lists no GPU does not carry the backend's drivers (~60 MB resident for Vulkan) for nothing."""

import json
import os
import subprocess
import sys

import pytest

from tests.gpu.conftest import BACKEND, REGISTRY, VISIBLE

CHOOSE = """
import json
from shards.engines.ggml import devices
chosen = devices.select("auto")
rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))
print(json.dumps({"device": chosen.backend, "loaded": sorted(devices._loaded.values()), "rss_kb": rss}))
"""


def choose(env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", CHOOSE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(BACKEND != "vulkan", reason="lavapipe's visibility switch is Vulkan's")
def test_auto_loads_the_backend_only_where_it_would_compute_on_it(gpu):
    hidden = {k: v for k, v in os.environ.items() if k != "GGML_VK_VISIBLE_DEVICES"}  # lavapipe unlisted
    on_cpu, on_gpu = choose(hidden), choose({**hidden, **VISIBLE})
    assert on_gpu == {**on_gpu, "device": REGISTRY[BACKEND], "loaded": [BACKEND]}
    assert on_cpu == {**on_cpu, "device": "CPU", "loaded": []}
    assert on_gpu["rss_kb"] - on_cpu["rss_kb"] > 20_000  # what the process no longer carries
