"""The facts of this machine and process that settings depend on and no flag gives: read once, by `Machine.here()`,
and handed to `settings_from_args`, which stays pure (tests hand it any machine they like)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from discovery.interfaces import default_advertise_host
from node.security import ENV_VAR


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class GpuMemory:
    """The GPU a node's engine computes on, and its memory: where that node's weights and KV cache live."""

    name: str  # as --list-devices names it: CUDA0, Vulkan0, ...
    description: str  # NVIDIA H200, ...
    free: int  # bytes
    total: int

    def __post_init__(self) -> None:
        if not self.name or not 0 < self.free <= self.total:
            raise ValueError(f"bad GPU memory report {self}: need a name and 0 < free <= total")

    @property
    def label(self) -> str:
        return f"{self.name} ({self.description})" if self.description else self.name


def gpu_memory(engine: str, device: str | None) -> GpuMemory | None:
    """The GPU the ggml engine will compute on for `device` (--device; auto: the fastest present), or None: another
    engine, the CPU, or a device that is missing (the engine refuses that one at start, naming the fix)."""
    if engine != "ggml" or device is None or device.lower() == "cpu":
        return None
    try:
        from shards.engines.ggml.devices import select
    except ImportError:  # the ggml extra isn't installed: the engine says so when it starts
        return None
    try:
        chosen = select(device)
    except (ValueError, LookupError):
        return None
    if chosen.is_cpu or chosen.memory_free <= 0:
        return None
    return GpuMemory(chosen.name, chosen.description, chosen.memory_free, max(chosen.memory_total, chosen.memory_free))


@dataclass(frozen=True)
class Machine:
    hostname: str
    available_memory: int  # bytes
    lan_host: str  # the address other machines most likely reach us at
    key_in_env: bool = False  # $EXO_NODE_CLUSTER_KEY holds a cluster key (load_secret reads it, or the flag's file)
    gpu: GpuMemory | None = None  # the GPU the node's engine computes on (`gpu_memory`), if any

    def __post_init__(self) -> None:
        if self.available_memory <= 0:
            raise ValueError(f"available memory must be positive, got {self.available_memory} bytes")

    @property
    def memory_for_layers(self) -> int:
        """What holds the node's weights and KV cache: its GPU's free memory, else the host's available memory."""
        return self.gpu.free if self.gpu is not None else self.available_memory

    @classmethod
    def here(cls, engine: str = "", device: str | None = None) -> Machine:
        key_in_env = bool(os.environ.get(ENV_VAR, "").strip())  # as node/security's load_secret decides
        gpu = gpu_memory(engine, device)
        return cls(socket.gethostname(), available_memory(), default_advertise_host(), key_in_env, gpu)
