"""How a node finds its peers, as one typed value (built from the flags by node/settings/, checked here once), and
the discovery objects it stands for."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from discovery.manual import ManualDiscovery
from discovery.static import StaticDiscovery, parse_peers
from discovery.udp import Announcement, UdpDiscovery

METHODS = ("udp", "manual", "none")  # --discovery: UDP broadcast, a JSON file, or only the static --peers


@dataclass(frozen=True)
class DiscoverySettings:
    """`peers` are found whatever the method; `interval` also paces membership's health checks. A peer not heard
    from for `timeout` seconds is dropped, so `timeout` must outlast a few announcements or peers would flap."""

    method: str = "udp"
    peers: tuple[str, ...] = ()  # HOST:PORT each
    port: int = 5678  # UDP broadcast port
    interval: float = 1.0  # seconds between announcements
    timeout: float = 5.0
    interfaces: tuple[str, ...] | None = None  # None: every non-loopback IPv4 interface
    config: Path | None = None  # the JSON peers file of method "manual" (read by no other method)
    wait_for_peers: int = 0  # the ready lines wait until this many peers are known

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--discovery must be one of {', '.join(METHODS)}, got {self.method!r}")
        parse_peers(",".join(self.peers))  # PeerListError naming the peer that is no HOST:PORT
        if self.method == "manual" and self.config is None:
            raise ValueError("--discovery manual needs --discovery-config FILE")
        if not 0 < self.port < 65536:
            raise ValueError(f"--discovery-port must be a UDP port (1-65535), got {self.port}")
        if not 0 < self.interval < self.timeout:
            raise ValueError(
                f"need 0 < --discovery-interval < --discovery-timeout (peers are dropped after the timeout without an "
                f"announcement), got {self.interval:g} and {self.timeout:g}"
            )
        if self.interfaces is not None and not all(self.interfaces):
            raise ValueError(f"--discovery-interfaces: empty interface name in {','.join(self.interfaces)!r}")
        if self.wait_for_peers < 0:
            raise ValueError(f"--wait-for-peers must be 0 (don't wait) or more, got {self.wait_for_peers}")

    def discoveries(self, announcement: Callable[[], Announcement], key: bytes | None) -> list:
        """The static peers, then the method's discovery (`key`: the cluster key's discovery key, signing UDP)."""
        found: list = [StaticDiscovery(list(self.peers))]
        if self.method == "manual":
            assert self.config is not None  # __post_init__
            found.append(ManualDiscovery(self.config))
        elif self.method == "udp":
            interfaces = list(self.interfaces) if self.interfaces is not None else None
            found.append(UdpDiscovery(announcement, self.port, self.interval, self.timeout, interfaces, key=key))
        return found
