"""Static peers: a fixed list of gRPC endpoints given on the command line (`--peers HOST:PORT,...`)."""

from __future__ import annotations

from discovery.address import parse_address


class PeerListError(ValueError):
    pass


def parse_peers(text: str | None) -> list[str]:
    """'a:1,b:2' -> ['a:1', 'b:2']; empty or None -> []."""
    out = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        try:
            parse_address(part)
        except ValueError:
            raise PeerListError(f"peer {part!r} is not HOST:PORT") from None
        out.append(part)
    return out


class StaticDiscovery:
    """Candidates never change; the node health-checks them and keeps the ones that answer."""

    def __init__(self, addresses: list[str]):
        self.addresses = list(dict.fromkeys(addresses))

    def candidates(self) -> list[str]:
        return list(self.addresses)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass
