"""The flags of a node among its peers: who it is and where gRPC listens, how it finds peers, and the cluster key."""

from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass
from pathlib import Path

from discovery.settings import METHODS, DiscoverySettings
from node.security import add_key_argument
from node.settings.machine import Machine

ALL_INTERFACES = ("0.0.0.0", "::", "")


def add_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("node and gRPC")
    g.add_argument("--node-id", help="default: stable id derived from host name and gRPC port")
    g.add_argument(
        "--host",
        help="gRPC bind address (default: 0.0.0.0 with a cluster key; without one 127.0.0.1, "
        "since an open gRPC port lets anyone who reaches it use the node)",
    )
    g.add_argument(
        "--advertise-host",
        help="address peers use to reach this node (default: --host, or the "
        "first non-loopback IPv4 when binding to all interfaces)",
    )
    g.add_argument("--grpc-port", type=int, default=50051, help="0 picks a free port (default 50051)")
    g.add_argument(
        "--link-port",
        type=int,
        default=0,
        help="the data link's TCP port, for activations and tokens between nodes (default: a free port, named to "
        "peers in health checks; give one where a firewall must let it through)",
    )
    g.add_argument("--no-link", action="store_true", help="send activations and tokens on gRPC's stream only")

    g = ap.add_argument_group("discovery", "how peers are found (docs/operations.md, Discovery)")
    g.add_argument("--peers", default="", help="static peers' gRPC endpoints, HOST:PORT,... (with any discovery)")
    g.add_argument(
        "--discovery",
        default="udp",
        choices=METHODS,
        help="find peers by UDP broadcast (default), a JSON file (manual), or only --peers (none)",
    )
    g.add_argument("--discovery-port", type=int, default=5678, help="UDP broadcast port (default 5678)")
    g.add_argument("--discovery-interval", type=float, default=1.0, help="seconds between announcements")
    g.add_argument(
        "--discovery-timeout",
        type=float,
        default=5.0,
        help="drop a peer not heard from for this many seconds (default 5)",
    )
    g.add_argument(
        "--discovery-interfaces",
        help="broadcast only on these interfaces (comma-separated names; default: every non-loopback IPv4 interface)",
    )
    g.add_argument("--discovery-config", type=Path, help="--discovery manual: the JSON peers file")
    g.add_argument("--wait-for-peers", type=int, default=0, help="print the ready lines only once N peers are known")

    add_key_argument(ap.add_argument_group("security", "the cluster key: mutual TLS and signed discovery"))


@dataclass(frozen=True)
class SecuritySettings:
    """Where the cluster key comes from: the flag's file, else $EXO_NODE_CLUSTER_KEY (node/security's
    `load_secret` reads it at start-up; the key itself is never a setting, so no repr or log can carry it)."""

    cluster_key_file: Path | None
    key_in_env: bool = False

    @property
    def keyed(self) -> bool:
        return self.cluster_key_file is not None or self.key_in_env


@dataclass(frozen=True)
class GrpcSettings:
    """Where the gRPC server listens, and the host peers reach it at (the port is the one it gets)."""

    host: str
    port: int  # 0: a free port
    advertise_host: str
    link: bool = True  # the data link (node/grpc/link/)
    link_port: int = 0  # 0: a free port (peers learn it from health checks)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--grpc-port must be a TCP port (0 picks a free one), got {self.port}")
        if not 0 <= self.link_port < 65536:
            raise ValueError(f"--link-port must be a TCP port (0 picks a free one), got {self.link_port}")
        if not self.advertise_host or self.advertise_host in ALL_INTERFACES:
            raise ValueError(f"peers can't reach {self.advertise_host!r}: give --advertise-host the address they use")


def security_from_args(args: argparse.Namespace, machine: Machine) -> SecuritySettings:
    return SecuritySettings(args.cluster_key_file, machine.key_in_env)


def node_id_from_args(args: argparse.Namespace, machine: Machine) -> str:
    """--node-id, else stable per host and gRPC port (a restarted node is the same node to its peers), else random
    (--grpc-port 0: no stable port to name it by)."""
    if args.node_id:
        return args.node_id
    if args.grpc_port:
        return uuid.uuid5(uuid.NAMESPACE_DNS, f"{machine.hostname}:{args.grpc_port}").hex[:12]
    return uuid.uuid4().hex[:12]


def grpc_from_args(args: argparse.Namespace, security: SecuritySettings, machine: Machine) -> GrpcSettings:
    """With a cluster key gRPC listens on every interface unless --host says otherwise; without one on loopback
    only, since an open port lets anyone who reaches it use the node."""
    host = args.host or ("0.0.0.0" if security.keyed else "127.0.0.1")
    advertise = args.advertise_host or (host if host not in ALL_INTERFACES else machine.lan_host)
    return GrpcSettings(host, args.grpc_port, advertise, not args.no_link, args.link_port)


def discovery_from_args(args: argparse.Namespace) -> DiscoverySettings:
    interfaces = args.discovery_interfaces
    return DiscoverySettings(
        method=args.discovery,
        peers=tuple(p.strip() for p in args.peers.split(",") if p.strip()),
        port=args.discovery_port,
        interval=args.discovery_interval,
        timeout=args.discovery_timeout,
        interfaces=tuple(i.strip() for i in interfaces.split(",") if i.strip()) if interfaces else None,
        config=args.discovery_config,
        wait_for_peers=args.wait_for_peers,
    )
