"""UDP broadcast discovery: announce ourselves on every allowed IPv4 interface, listen for the others.

Announcements are small versioned JSON objects. Everything received is validated (size, JSON, schema, version)
and junk is counted and dropped; our own packets are ignored. A peer heard within `timeout` seconds is a
candidate; the node's membership confirms candidates with a gRPC HealthCheck before using them.

With a cluster key (`key`: the cluster secret's discovery key) every announcement is signed and only signed,
fresh, first-seen packets are accepted (see `signed.py`); what is dropped is counted (`udp_unsigned`,
`udp_bad_signature`, `udp_stale`, `udp_future`, `udp_replayed`). Without a key, announcements are plain JSON as
before, and *signed* packets are dropped and counted (`udp_signed_ignored`) with one warning: a keyless node
cannot check them, and their senders only accept TLS peers holding the key, so taking them would only make us
health-check nodes we can never join. The warning tells the operator this node is missing the cluster key.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from discovery.interfaces import Interface, ipv4_interfaces
from discovery.signed import OVERHEAD, PacketAuth, Rejected, is_signed

log = logging.getLogger(__name__)

VERSION = 1
APP = "exo-node"
MAX_PACKET = 1024
_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


@dataclass(frozen=True)
class Announcement:
    node_id: str
    grpc_port: int
    model_id: str
    engine: str
    memory_bytes: int

    def encode(self) -> bytes:
        return json.dumps(
            {
                "app": APP,
                "v": VERSION,
                "node_id": self.node_id,
                "grpc_port": self.grpc_port,
                "model_id": self.model_id,
                "engine": self.engine,
                "memory_bytes": self.memory_bytes,
            }
        ).encode()


class BadPacket(ValueError):
    pass


def parse_announcement(data: bytes) -> Announcement:
    if len(data) > MAX_PACKET:
        raise BadPacket("too large")
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise BadPacket("not JSON") from None
    if not isinstance(obj, dict) or obj.get("app") != APP:
        raise BadPacket("not an exo-node announcement")
    if obj.get("v") != VERSION:
        raise BadPacket(f"unsupported version {obj.get('v')!r}")
    node_id, port, model, engine, memory = (
        obj.get(k) for k in ("node_id", "grpc_port", "model_id", "engine", "memory_bytes")
    )
    if not isinstance(node_id, str) or not _ID.match(node_id):
        raise BadPacket("bad node_id")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise BadPacket("bad grpc_port")
    if not isinstance(model, str) or len(model) > 256 or not isinstance(engine, str) or len(engine) > 32:
        raise BadPacket("bad model_id or engine")
    if not isinstance(memory, int) or isinstance(memory, bool) or memory < 0:
        raise BadPacket("bad memory_bytes")
    return Announcement(node_id, port, model, engine, memory)


class UdpDiscovery:
    def __init__(
        self,
        announcement: Callable[[], Announcement],
        port: int = 5678,
        interval: float = 1.0,
        timeout: float = 5.0,
        interfaces: list[str] | None = None,
        key: bytes | None = None,
    ):
        self.announcement, self.port, self.interval, self.timeout = announcement, port, interval, timeout
        self.allowed = interfaces  # None: every non-loopback IPv4 interface
        self.auth = PacketAuth(key) if key is not None else None
        self._warned_signed = False
        self.stats: Counter[str] = Counter()
        self.heard: dict[str, tuple[str, float]] = {}  # node_id -> (host:port, when last heard, monotonic)
        self._transport: asyncio.DatagramTransport | None = None
        self._task: asyncio.Task | None = None

    def interfaces(self) -> list[Interface]:
        if self.allowed is None:
            return ipv4_interfaces()
        return [i for i in ipv4_interfaces(include_loopback=True) if i.name in self.allowed]

    def candidates(self) -> list[str]:
        now = time.monotonic()
        for node_id, (_, seen) in list(self.heard.items()):
            if now - seen > self.timeout:
                log.info("no announcement from %s for %.1fs: dropping it", node_id, now - seen)
                del self.heard[node_id]
        return [address for address, _ in self.heard.values()]

    async def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # several nodes on one host share the port
        if hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        sock.bind(("", self.port))
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.create_datagram_endpoint(lambda: _Protocol(self), sock=sock)
        self._task = asyncio.create_task(self._announce_loop(), name="udp-announce")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._transport:
            self._transport.close()

    async def _announce_loop(self) -> None:
        while True:
            payload = self.announcement().encode()
            for iface in self.interfaces():
                # Signed per send: each copy gets its own nonce, or a host hearing us on two interfaces would
                # count the second copy as a replay.
                packet = self.auth.sign(payload) if self.auth else payload
                try:
                    self._transport.sendto(packet, (iface.broadcast, self.port))
                    self.stats["udp_sent"] += 1
                except OSError as e:
                    self.stats["udp_send_errors"] += 1
                    log.debug("broadcast on %s failed: %s", iface.name, e)
            await asyncio.sleep(self.interval)

    def received(self, data: bytes, addr: tuple[str, int]) -> None:
        if len(data) > MAX_PACKET + OVERHEAD:
            self.stats["udp_invalid"] += 1  # before any work on it, signed or not
            return
        if self.auth is not None:
            try:
                data = self.auth.open(data)
            except Rejected as e:
                self.stats[f"udp_{e.reason}"] += 1
                log.debug("dropped discovery packet from %s: %s", addr[0], e.reason)
                return
        elif is_signed(data):
            self.stats["udp_signed_ignored"] += 1
            if not self._warned_signed:
                self._warned_signed = True
                log.warning(
                    "heard signed discovery announcements (from %s) but this node has no cluster key: "
                    "they are ignored; start it with --cluster-key-file to join that cluster",
                    addr[0],
                )
            return
        try:
            a = parse_announcement(data)
        except BadPacket as e:
            self.stats["udp_invalid"] += 1
            log.debug("ignored packet from %s: %s", addr[0], e)
            return
        if a.node_id == self.announcement().node_id:
            self.stats["udp_self"] += 1
            return
        self.stats["udp_received"] += 1
        if a.node_id not in self.heard:
            log.info("heard %s at %s:%d", a.node_id, addr[0], a.grpc_port)
        self.heard[a.node_id] = (f"{addr[0]}:{a.grpc_port}", time.monotonic())


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, owner: UdpDiscovery):
        self.owner = owner

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            self.owner.received(data, addr)
        except Exception:  # never let one packet kill the listener
            self.owner.stats["udp_invalid"] += 1
            log.exception("error handling a discovery packet")

    def error_received(self, exc: Exception) -> None:
        self.owner.stats["udp_socket_errors"] += 1
