"""The Vulkan tier: the ggml engine on a real Vulkan device, against the CPU engine.

On a machine without a GPU the device is Mesa's lavapipe (a conformant Vulkan implementation that runs its shaders
on the CPU), which ggml lists only with GGML_VK_VISIBLE_DEVICES=0: the tier sets it while it loads the backend and
for the nodes it starts. Every test skips, saying why, when ggml-python, the Vulkan backend built for it
(`exo-node build-backend vulkan`) or a Vulkan device is missing.
"""

from __future__ import annotations

import os

import pytest

VISIBLE = {"GGML_VK_VISIBLE_DEVICES": os.environ.get("GGML_VK_VISIBLE_DEVICES", "0")}


@pytest.fixture(scope="session")
def vulkan():
    """The Vulkan device (a shards.engines.ggml.devices.Device), its backend loaded into this process."""
    pytest.importorskip("ggml", reason="the ggml extra is not installed")
    from shards.engines.ggml.devices import backends_dir, built_backends, devices, load_backends

    if not any(b.backend == "vulkan" for b in built_backends()):
        pytest.skip(f"no Vulkan backend built in {backends_dir()}: run `exo-node build-backend vulkan`")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in VISIBLE.items():
            mp.setenv(k, v)
        loaded = load_backends()
    found = [d for d in devices() if d.backend == "Vulkan"]
    if "vulkan" not in loaded or not found:
        pytest.skip(f"the Vulkan backend did not load or lists no device (loaded: {loaded}); see vulkaninfo --summary")
    return found[0]


@pytest.fixture
def vulkan_env(vulkan, monkeypatch):
    """The device, with the environment that makes node processes list it too."""
    for k, v in VISIBLE.items():
        monkeypatch.setenv(k, v)
    return vulkan
