"""Record every frame crossing a network interface for a while (run inside the namespace that owns it, as root).

    python -m tests.support.capture IFACE SECONDS OUT     # IFACE "any": every interface of the namespace

It stops after SECONDS, or as soon as its standard input closes (the test closes it once the traffic it wants to
see has crossed, instead of waiting out a guessed window); frames already queued on the socket are kept.

(On a bridge, frames forwarded from port to port never reach the bridge device itself: capture the ports, "any".)

A raw AF_PACKET socket, so no tcpdump is needed: the test asserts what the bytes on the wire do and don't contain.
"""

from __future__ import annotations

import socket
import sys
import threading
import time


def main(iface: str, seconds: float, out: str) -> None:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))  # ETH_P_ALL
    if iface != "any":
        sock.bind((iface, 0))
    sock.settimeout(0.2)
    told = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), told.set()), daemon=True).start()  # returns at EOF
    print("capturing", flush=True)
    end = time.monotonic() + seconds
    with open(out, "wb") as f:
        while time.monotonic() < end and not told.is_set():
            try:
                f.write(sock.recv(65535))
            except TimeoutError:
                pass
        sock.setblocking(False)
        while True:  # what crossed before the stop is still queued: keep it
            try:
                f.write(sock.recv(65535))
            except BlockingIOError:
                break


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3])
