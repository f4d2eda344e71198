"""Everything `exo-node` is told, from its flags: `parse_args`, then `settings_from_args`, the one pure function that
turns them into the typed settings the parts take (the facts it needs of the machine are handed to it as a
`Machine`), so what a flag does is checked without starting anything (tests/unit/test_settings.py). node/cli.py's
`main` is the only caller; nothing it starts sees an argparse object.

Each module here is one part's flags, in argument groups (what `exo-node --help` shows), beside the function that
reads them into that part's settings: cluster.py (node id and gRPC, discovery, the cluster key), model.py (the
model, the engine, fetching), serving.py (requests, KV cache, scheduling, speculation), api.py (the HTTP API). A new
flag goes in its group's `add_flags` and is read in the same module; the settings types check themselves and say
which flag to fix. Types that a layer below owns live there (`NodeSettings`, `ApiSettings`, `DiscoverySettings`,
`FetchSettings`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from discovery.settings import DiscoverySettings
from node.fetch.startup import FetchSettings
from node.runtime.settings import NodeSettings
from node.settings import api, cluster, model, serving
from node.settings.api import HttpSettings
from node.settings.cluster import GrpcSettings, SecuritySettings
from node.settings.machine import Machine
from node.settings.model import EngineSettings
from shards.formats.packaged import DEMO_DIR

__all__ = [
    "DEMO_MODEL",
    "EngineSettings",
    "GrpcSettings",
    "HttpSettings",
    "Machine",
    "SecuritySettings",
    "Settings",
    "parse_args",
    "parser",
    "settings_from_args",
]

DEMO_MODEL = DEMO_DIR  # the bundled demo model (--model exo-demo)
LOG_LEVELS = ("debug", "info", "warning", "error")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="exo-node", description="Serve a language model split across machines.")
    model.add_flags(ap)
    cluster.add_flags(ap)
    api.add_flags(ap)
    serving.add_flags(ap)
    ap.add_argument_group("logging").add_argument("--log-level", default="info", choices=LOG_LEVELS)
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return parser().parse_args(argv)


@dataclass(frozen=True)
class Settings:
    """What one node runs with: `model` is --model as given (a packaged name, a path, or the id of a model to
    fetch: node/fetch/startup.py's `locate_model` tells which)."""

    model: str
    engine: EngineSettings
    node: NodeSettings
    grpc: GrpcSettings
    discovery: DiscoverySettings
    security: SecuritySettings
    fetch: FetchSettings
    http: HttpSettings | None  # None: --no-api
    drain_timeout: float  # on SIGTERM, wait at most this long for requests in flight

    def __post_init__(self) -> None:
        if self.engine.name != self.node.engine:
            raise ValueError(f"one engine per node: {self.engine.name!r} and {self.node.engine!r}")
        if not self.drain_timeout >= 0:
            raise ValueError(f"--drain-timeout must be 0 (leave at once) or more, got {self.drain_timeout}")


def settings_from_args(args: argparse.Namespace, *, machine: Machine) -> Settings:
    """The settings every part takes, from the flags; a ValueError naming the flag to fix for nonsense."""
    security = cluster.security_from_args(args, machine)
    engine = model.engine_from_args(args)
    node_id = cluster.node_id_from_args(args, machine)
    return Settings(
        model=args.model,
        engine=engine,
        node=serving.node_from_args(args, node_id=node_id, engine=engine, machine=machine),
        grpc=cluster.grpc_from_args(args, security, machine),
        discovery=cluster.discovery_from_args(args),
        security=security,
        fetch=model.fetch_from_args(args),
        http=api.http_from_args(args),
        drain_timeout=args.drain_timeout,
    )
