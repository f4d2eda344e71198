"""Record every frame crossing a network interface for a while (run inside the namespace that owns it, as root).

    python -m tests.support.capture IFACE SECONDS OUT     # IFACE "any": every interface of the namespace

(On a bridge, frames forwarded from port to port never reach the bridge device itself: capture the ports, "any".)

A raw AF_PACKET socket, so no tcpdump is needed: the test asserts what the bytes on the wire do and don't contain.
"""

from __future__ import annotations

import socket
import sys
import time


def main(iface: str, seconds: float, out: str) -> None:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))  # ETH_P_ALL
    if iface != "any":
        sock.bind((iface, 0))
    sock.settimeout(0.2)
    print("capturing", flush=True)
    end = time.monotonic() + seconds
    with open(out, "wb") as f:
        while time.monotonic() < end:
            try:
                f.write(sock.recv(65535))
            except TimeoutError:
                pass


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3])
