"""The GPU tier: the ggml engine on a real device of one GPU backend, against the CPU engine.

EXO_GPU_BACKEND names the backend (vulkan, cuda, hip, metal; default vulkan). On a machine without a GPU the Vulkan
device is Mesa's lavapipe (a conformant Vulkan implementation that runs its shaders on the CPU), which ggml lists
only with GGML_VK_VISIBLE_DEVICES=0: the tier sets it while it loads the backend and for the nodes it starts. Every
test skips, saying why, when ggml-python, the backend built for it (`exo-node build-backend NAME`) or a device of
it is missing.
"""

from __future__ import annotations

import os

import pytest

BACKEND = os.environ.get("EXO_GPU_BACKEND", "vulkan").lower()
# the name ggml's registry gives each backend (what Device.backend holds)
REGISTRY = {"vulkan": "Vulkan", "cuda": "CUDA", "hip": "ROCm", "metal": "MTL"}
VISIBLE = {"GGML_VK_VISIBLE_DEVICES": os.environ.get("GGML_VK_VISIBLE_DEVICES", "0")} if BACKEND == "vulkan" else {}


@pytest.fixture(scope="session")
def gpu():
    """The backend's first device (a shards.engines.ggml.devices.Device), its backend loaded into this process."""
    pytest.importorskip("ggml", reason="the ggml extra is not installed")
    from shards.engines.ggml.devices import backends_dir, built_backends, devices, load_backends

    if BACKEND not in REGISTRY:
        pytest.fail(f"EXO_GPU_BACKEND={BACKEND!r}: one of {', '.join(REGISTRY)}")
    if not any(b.backend == BACKEND for b in built_backends()):
        pytest.skip(f"no {BACKEND} backend built in {backends_dir()}: run `exo-node build-backend {BACKEND}`")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in VISIBLE.items():
            mp.setenv(k, v)
        loaded = load_backends()
    found = [d for d in devices() if d.backend == REGISTRY[BACKEND]]
    if BACKEND not in loaded or not found:
        pytest.skip(f"the {BACKEND} backend did not load or lists no device (loaded: {loaded})")
    return found[0]


@pytest.fixture
def gpu_env(gpu, monkeypatch):
    """The device, with the environment that makes node processes list it too."""
    for k, v in VISIBLE.items():
        monkeypatch.setenv(k, v)
    return gpu
