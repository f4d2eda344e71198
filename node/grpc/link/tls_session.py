"""A link's TLS as bytes in and bytes out (`ssl.SSLObject` over memory BIOs), for both sides of the link.

Why: asyncio's TLS transport encrypts only on the event loop, so under a cluster key the engine thread could not
write a pass's message to the peer as the pass ends (node/runtime/early_send.py); it went through the loop. Here
the link's owner encrypts under the lock every write of the link already holds, from whichever thread writes, and
puts the records on the plain socket itself, in the order they were made. The server's side takes its records off
the plain socket the same way: asyncio's TLS protocol, a layer of Python calls between the socket and the link's
own, cost every keyed hop its receiver's time (docs/benchmarks.md). The handshake and the checks are the
context's own (node/security/tls.py: TLS 1.3, the peer's leaf checked against the cluster CA before any byte of
the protocol goes): this only moves the bytes.

Not thread-safe by itself: every call is made under its owner's lock.
"""

from __future__ import annotations

import ssl

_READ = 1 << 16  # plaintext read at a time


class TlsSession:
    def __init__(self, context: ssl.SSLContext, server_hostname: str | None, server_side: bool = False):
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._in, self._out, server_side=server_side, server_hostname=server_hostname)
        self.done = False  # the handshake finished: records may be written and read

    def handshake(self) -> bool:
        """One step of the handshake with what came so far (`feed`): whether it is done. ssl.SSLError where the
        peer's leaf or the protocol is refused."""
        if not self.done:
            try:
                self._tls.do_handshake()
                self.done = True
            except ssl.SSLWantReadError:
                pass
        return self.done

    def feed(self, data: bytes) -> None:
        """Bytes that came off the socket."""
        self._in.write(data)

    def read(self) -> bytes:
        """The plaintext the records fed so far hold (b"" for none yet); ssl.SSLError for a broken stream,
        ConnectionResetError once the peer closed its side."""
        chunks = []
        while True:
            try:
                chunk = self._tls.read(_READ)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                raise ConnectionResetError("the peer ended the TLS session") from None
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)

    def seal(self, data: bytes) -> bytes:
        """`data` as the records to write, after whatever the session owes the peer first."""
        self._tls.write(data)
        return self._out.read()

    def peercert(self) -> dict | None:
        """The peer's leaf, as `ssl.SSLSocket.getpeercert` gives it (None before the handshake)."""
        return self._tls.getpeercert() if self.done else None

    def owed(self) -> bytes:
        """What the session has to write now (the handshake's messages, answers to the peer's own)."""
        return self._out.read()
