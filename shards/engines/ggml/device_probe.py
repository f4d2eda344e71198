"""Which devices the built GPU backends would give this process, found out by a child process that loads them.

Loading a backend costs memory for the process's whole life, whether or not a device of it is used: Vulkan's
loader and its drivers (Mesa's LLVM among them) are ~60 MB resident, and ggml has no safe way to unload them. On a
machine whose Vulkan lists no GPU (a server, a VM: ggml skips CPU-type devices such as lavapipe) that is memory a
node's share of a model can't use. So `select("auto")` asks a child first (a second or so, once per process and
environment) and loads the backends here only when a device of them would be chosen. Its answer is that of this
process (same interpreter, backends and environment). A child that fails or hangs says nothing: the caller then
loads the backends itself, as without a probe.

    python -m shards.engines.ggml.devices   # the child: one JSON object, {"devices": [Device fields, ...]}
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

log = logging.getLogger(__name__)
TIMEOUT = 60.0  # seconds the child may take (a driver's first start compiles its pipelines' cache)
CHILD = "shards.engines.ggml.devices"  # the module whose main lists the devices
_answers: dict[tuple, tuple | None] = {}  # what each environment's probe said


def environment_key() -> tuple:
    """What a device listing depends on beyond the built backends: ggml's and the drivers' visibility settings."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("GGML_") or "VISIBLE_DEVICES" in k))


def probe(built: tuple[str, ...]) -> tuple[dict, ...] | None:
    """The devices (devices.Device's fields) a process listing after loading the backends `built` (their libraries)
    would have, or None when the child could not say."""
    key = (built, environment_key())
    if key not in _answers:
        _answers[key] = _ask()
    return _answers[key]


def _ask() -> tuple[dict, ...] | None:
    try:
        done = subprocess.run(
            [sys.executable, "-m", CHILD], capture_output=True, text=True, timeout=TIMEOUT, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"exit status {done.returncode}: {done.stderr.strip()[-300:]}")
        listed = json.loads(done.stdout.strip().splitlines()[-1])["devices"]
        if not isinstance(listed, list) or not all(isinstance(d, dict) for d in listed):
            raise ValueError(f"not a list of devices: {listed!r}"[:300])
        return tuple(listed)
    except (OSError, subprocess.TimeoutExpired, RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        log.warning("ggml: could not list the built backends' devices in a child process (%s): loading them here", e)
        return None
