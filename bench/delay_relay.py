"""A TCP relay holding every byte a set time each way: a link's delay where the kernel has no netem (sch_netem).

    python -m bench.delay_relay DELAY_FILE LISTEN_HOST:PORT=TARGET_HOST:PORT [...]

Each accepted connection opens one to its target. Per direction a reader thread stamps each chunk as it arrives
and a writer thread sends it once stamp + delay has passed: `time.sleep` wakes within tens of microseconds, where
an event loop's timers round up to a millisecond. The delay (ms) is re-read from DELAY_FILE every 0.2 s, so a
benchmark changes it between settings without breaking connections. What it does not model: the relay's own TCP
legs see no delay, so acknowledgements (and TCP's window growth) are those of a short link.
"""

from __future__ import annotations

import queue
import socket
import sys
import threading
import time
from pathlib import Path


class Delay:
    """The delay in seconds, following DELAY_FILE (an unreadable file keeps the last value)."""

    def __init__(self, path: Path):
        self.path, self.seconds = path, 0.0
        self.refresh()
        threading.Thread(target=self._follow, daemon=True).start()

    def refresh(self) -> None:
        try:
            self.seconds = max(0.0, float(self.path.read_text()) / 1000)
        except (OSError, ValueError):
            pass

    def _follow(self) -> None:
        while True:
            time.sleep(0.2)
            self.refresh()


def forward(src: socket.socket, dst: socket.socket, delay: Delay) -> None:
    """Bytes from `src` to `dst`, each chunk `delay` after it arrived; EOF or an error ends both directions."""
    chunks: queue.SimpleQueue[tuple[float, bytes] | None] = queue.SimpleQueue()

    def read() -> None:
        try:
            while data := src.recv(1 << 16):
                chunks.put((time.perf_counter(), data))
        except OSError:
            pass
        chunks.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        while (item := chunks.get()) is not None:
            if (wait := item[0] + delay.seconds - time.perf_counter()) > 0:
                time.sleep(wait)
            dst.sendall(item[1])
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        for s in (src, dst):
            s.close()


def connect(client: socket.socket, target: tuple[str, int], delay: Delay) -> None:
    try:
        upstream = socket.create_connection(target, timeout=10)
    except OSError:
        client.close()  # the target is not up yet: the client retries
        return
    upstream.settimeout(None)
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the relayed protocols all set it themselves
    threading.Thread(target=forward, args=(client, upstream, delay), daemon=True).start()
    threading.Thread(target=forward, args=(upstream, client, delay), daemon=True).start()


def serve(server: socket.socket, target: tuple[str, int], delay: Delay) -> None:
    while True:
        client, _ = server.accept()
        threading.Thread(target=connect, args=(client, target, delay), daemon=True).start()


def endpoint(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main() -> None:
    if len(sys.argv) < 3 or any("=" not in a for a in sys.argv[2:]):
        raise SystemExit(__doc__.split("\n\n")[1].strip())
    delay = Delay(Path(sys.argv[1]))
    pairs = [pair.split("=", 1) for pair in sys.argv[2:]]
    servers = [(socket.create_server(endpoint(listen)), endpoint(target)) for listen, target in pairs]  # fail here
    for server, target in servers:
        threading.Thread(target=serve, args=(server, target, delay), daemon=True).start()
    threading.Event().wait()


if __name__ == "__main__":
    main()
