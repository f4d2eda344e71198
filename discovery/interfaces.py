"""This host's IPv4 interfaces (address and broadcast), without sending any traffic."""

from __future__ import annotations

import ipaddress
import socket
import struct
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Interface:
    name: str
    address: str
    broadcast: str


def ipv4_interfaces(include_loopback: bool = False) -> list[Interface]:
    """Interfaces that are up with an IPv4 address (Linux ioctls; elsewhere only the host name's address)."""
    if not sys.platform.startswith("linux"):
        try:
            addr = socket.gethostbyname(socket.gethostname())
        except OSError:
            return []
        return (
            [] if addr.startswith("127.") and not include_loopback else [Interface("default", addr, "255.255.255.255")]
        )
    import fcntl

    out = []
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack("256s", name.encode()[:15])
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR
                mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x891B, req)[20:24])  # SIOCGIFNETMASK
            except OSError:
                continue  # no IPv4 address on this interface
        if addr.startswith("127.") and not include_loopback:
            continue
        net = ipaddress.IPv4Network(f"{addr}/{mask}", strict=False)
        out.append(Interface(name, addr, str(net.broadcast_address)))
    return out


def default_advertise_host() -> str:
    """The address other machines most likely reach us at: the first non-loopback IPv4, else loopback."""
    found = ipv4_interfaces()
    return found[0].address if found else "127.0.0.1"
