"""The GPU tier: the ggml engine on a real device of one GPU backend, against the CPU engine.

EXO_GPU_BACKEND names the backend (vulkan, cuda, hip, metal; default vulkan). On a machine without a GPU the Vulkan
device is Mesa's lavapipe (a conformant Vulkan implementation that runs its shaders on the CPU), which ggml lists
only with GGML_VK_VISIBLE_DEVICES=0: the tier sets it while it loads the backend and for the nodes it starts. Every
test skips, saying why, when ggml-python, the backend built for it (`exo-node build-backend NAME`) or a device of
it is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

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
    if "llvmpipe" in found[0].description:
        refuse_old_lavapipe()
    return found[0]


def mesa_version() -> tuple[int, int] | None:
    """The Mesa release of the Vulkan driver vulkaninfo reports first, or None where vulkaninfo can't tell."""
    if not shutil.which("vulkaninfo"):
        return None
    run = subprocess.run(
        ["vulkaninfo", "--summary"], capture_output=True, text=True, timeout=60, env=os.environ | VISIBLE
    )
    found = re.search(r"driverInfo\s*=\s*Mesa (\d+)\.(\d+)", run.stdout)
    return (int(found[1]), int(found[2])) if found else None


def refuse_old_lavapipe() -> None:
    """Lavapipe before Mesa 23 (Debian 12's 22.3.6) corrupts the process's heap when device buffers are freed while
    it runs on: with a step graph's compute buffers dropped between steps, or an engine closed and another started,
    glibc aborts a later step ("corrupted double-linked list") or the driver's queue thread segfaults. The same runs
    pass on Mesa 25.0 (Debian's bookworm-backports), so the tier refuses the old driver rather than fail at random."""
    version = mesa_version()
    if version is not None and version < (23, 0):
        pytest.fail(
            f"lavapipe from Mesa {version[0]}.{version[1]} corrupts memory when device buffers are freed; install a "
            "newer Mesa (Debian 12: apt-get install -t bookworm-backports mesa-vulkan-drivers, as .ci/run does)"
        )


@pytest.fixture
def gpu_env(gpu, monkeypatch):
    """The device, with the environment that makes node processes list it too."""
    for k, v in VISIBLE.items():
        monkeypatch.setenv(k, v)
    return gpu
