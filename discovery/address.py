"""`host:port` endpoints: the one parser every part of exo-node uses for them."""

from __future__ import annotations


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' (IPv6 hosts in brackets) -> (host, port); ValueError naming the text otherwise."""
    host, sep, port = address.rpartition(":")
    # isascii: "²".isdigit() is True, but int("²") fails
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)
