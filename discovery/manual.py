"""Manual discovery: peers listed in a JSON file, re-read whenever it changes.

    {"peers": [{"id": "node-b", "address": "192.168.1.11", "port": 50051,
                "capabilities": {"memory_bytes": 17179869184, "engine": "numpy"}}]}

`capabilities` is optional and informational: a peer's own HealthCheck answer is what the node uses.
A broken file is reported and the last good list kept (at start-up, with no good list yet, it is an error).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
MAX_PEERS = 1024


class ManualConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ManualPeer:
    node_id: str
    address: str  # host:port


def parse_config(text: str, source: str) -> list[ManualPeer]:
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ManualConfigError(f"{source}: not valid JSON: {e}") from None
    peers = obj.get("peers") if isinstance(obj, dict) else None
    if not isinstance(peers, list) or len(peers) > MAX_PEERS:
        raise ManualConfigError(f'{source}: expected {{"peers": [...]}} with at most {MAX_PEERS} entries')
    out = []
    for i, p in enumerate(peers):
        where = f"{source}: peers[{i}]"
        if not isinstance(p, dict):
            raise ManualConfigError(f"{where} must be an object")
        node_id, host, port, caps = p.get("id"), p.get("address"), p.get("port"), p.get("capabilities", {})
        if not isinstance(node_id, str) or not node_id or len(node_id) > 64:
            raise ManualConfigError(f"{where}.id must be a non-empty string (at most 64 characters)")
        if not isinstance(host, str) or not host or len(host) > 255 or any(c.isspace() for c in host):
            raise ManualConfigError(f"{where}.address must be a host name or IP address")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ManualConfigError(f"{where}.port must be an integer in 1-65535")
        if not isinstance(caps, dict):
            raise ManualConfigError(f"{where}.capabilities must be an object")
        out.append(ManualPeer(node_id, f"{host}:{port}"))
    return out


class ManualDiscovery:
    def __init__(self, path: Path):
        self.path = path
        self.peers = parse_config(self._read(), str(path))  # fails loudly at start-up
        self._stamp = self._stat()
        self.reloads = 0

    def _read(self) -> str:
        try:
            return self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ManualConfigError(f"{self.path}: cannot read: {e}") from None

    def _stat(self) -> tuple[float, int] | None:
        try:
            st = self.path.stat()
            return st.st_mtime_ns, st.st_size
        except OSError:
            return None

    def candidates(self) -> list[str]:
        stamp = self._stat()
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self.peers = parse_config(self._read(), str(self.path))
                self.reloads += 1
                log.info("%s changed: %d peers", self.path, len(self.peers))
            except ManualConfigError as e:
                log.error("%s; keeping the last good list of %d peers", e, len(self.peers))
        return [p.address for p in self.peers]

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass
