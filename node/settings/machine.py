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
class Machine:
    hostname: str
    available_memory: int  # bytes
    lan_host: str  # the address other machines most likely reach us at
    key_in_env: bool = False  # $EXO_NODE_CLUSTER_KEY holds a cluster key (load_secret reads it, or the flag's file)

    def __post_init__(self) -> None:
        if self.available_memory <= 0:
            raise ValueError(f"available memory must be positive, got {self.available_memory} bytes")

    @classmethod
    def here(cls) -> Machine:
        key_in_env = bool(os.environ.get(ENV_VAR, "").strip())  # as node/security's load_secret decides
        return cls(socket.gethostname(), available_memory(), default_advertise_host(), key_in_env)
