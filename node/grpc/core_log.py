"""gRPC's C core writes to the process's stderr itself, past Python's logging: one line per failed TLS handshake
(~200 bytes), so anyone who can reach the port can fill the log (2000 attempts: 400 KB). This passes the core's
stderr through a filter that lets the first handshake failure of each `period` through and then says, once per
period, how many more there were; every other line passes unchanged, in order.

It works at the file descriptor: fd 2 becomes a pipe that a thread reads line by line and writes on to the
original stderr. Python's own writes to sys.stderr go the same way, so nothing is reordered. `close` (also run at
exit) puts fd 2 back and drains the pipe.
"""

from __future__ import annotations

import atexit
import os
import re
import select
import sys
import threading
import time
from collections.abc import Callable

HANDSHAKE_FAILED = re.compile(rb"Handshake failed")


class HandshakeLogLimiter:
    """Which lines go out: the pure part, driven by `line` and `tick` (the thread calls both)."""

    def __init__(self, period: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.period, self.clock = period, clock
        self.window_start = float("-inf")
        self.suppressed = 0
        self.total = 0  # handshake failures seen (all of them, shown or not)

    def line(self, data: bytes) -> bytes:
        """What to write for one line read from the core (b"" for nothing)."""
        if not HANDSHAKE_FAILED.search(data):
            return data
        self.total += 1
        out = self.tick()
        if self.clock() - self.window_start >= self.period:
            self.window_start = self.clock()
            return out + data
        self.suppressed += 1
        return out

    def tick(self) -> bytes:
        """The summary of the period just over, if any line was held back in it."""
        if self.suppressed and self.clock() - self.window_start >= self.period:
            self.window_start = self.clock()
            return self.flush()
        return b""

    def flush(self) -> bytes:
        """The summary of the lines held back so far (at exit, whatever the period)."""
        n, self.suppressed = self.suppressed, 0
        return (
            (
                f"exo-node: {n} more failed TLS handshakes (peers without the cluster key, or probes) in the last "
                f"{self.period:g}s; one is shown per period\n"
            ).encode()
            if n
            else b""
        )


class CoreLogFilter:
    def __init__(self, limiter: HandshakeLogLimiter | None = None):
        self.limiter = limiter or HandshakeLogLimiter()
        self._original: int | None = None
        self._reader: threading.Thread | None = None

    def install(self) -> None:
        read_end, write_end = os.pipe()
        self._original = os.dup(2)
        os.dup2(write_end, 2)
        os.close(write_end)
        self._reader = threading.Thread(target=self._pump, args=(read_end,), name="core-log-filter", daemon=True)
        self._reader.start()
        atexit.register(self.close)

    def _pump(self, read_end: int) -> None:
        pending = b""
        try:
            while True:
                if not select.select([read_end], [], [], 1.0)[0]:
                    self._write(self.limiter.tick())  # a quiet second: the period's summary, if it is over
                    continue
                chunk = os.read(read_end, 65536)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                self._write(b"".join(self.limiter.line(line + b"\n") for line in lines))
            self._write(self.limiter.line(pending) if pending else b"")
            self._write(self.limiter.flush())
        finally:
            os.close(read_end)

    def _write(self, data: bytes) -> None:
        if data and self._original is not None:
            os.write(self._original, data)

    def close(self) -> None:
        """fd 2 back to the original stderr; what is still in the pipe is written first."""
        if self._original is None:
            return
        sys.stderr.flush()
        os.dup2(self._original, 2)  # closes the pipe's last write end: the reader sees EOF
        if self._reader is not None:
            self._reader.join(5)
        original, self._original = self._original, None
        os.close(original)
