"""gRPC core's line per failed TLS handshake is rate-limited: anyone reaching the port can't fill the log."""

import subprocess
import sys
import textwrap

from node.grpc.core_log import HandshakeLogLimiter

FAILED = b"I1201 11:26:05.245901 9557 ssl_transport_security.cc:2563] Handshake failed with error SSL_ERROR_SSL\n"


def test_one_failure_per_period_goes_out_then_a_count_of_the_rest():
    now = [0.0]
    limiter = HandshakeLogLimiter(period=60, clock=lambda: now[0])
    out = [limiter.line(FAILED) for _ in range(100)]
    assert out[0] == FAILED and not any(out[1:])
    assert limiter.line(b"other line\n") == b"other line\n"  # everything else passes, in order
    now[0] = 61
    assert limiter.tick().startswith(b"exo-node: 99 more failed TLS handshakes")
    assert limiter.tick() == b"" and limiter.total == 100


def test_a_keyed_server_probed_2000_times_logs_a_few_lines():
    script = textwrap.dedent("""
        import asyncio, socket
        from node.grpc.core_log import CoreLogFilter
        CoreLogFilter().install()
        from node.grpc.server import GrpcServer
        from node.security import ClusterKey, generate_secret

        async def main():
            server = GrpcServer("127.0.0.1", 0, 4 << 20, ClusterKey(generate_secret()).tls("srv"))
            class Node:
                max_tensor_bytes = 1
            await server.start(Node())
            for _ in range(200):
                s = socket.create_connection(("127.0.0.1", server.port))
                s.sendall(b"\\x16\\x03\\x01\\x00\\x05not-a-handshake" * 3)
                s.recv(100)
                s.close()
            await asyncio.sleep(0.3)
            await server.stop(0)
            print("done", flush=True)
        asyncio.run(main())
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120, cwd=".")
    assert run.returncode == 0 and run.stdout == b"done\n", run.stderr[-2000:]
    lines = run.stderr.splitlines()
    assert sum(b"Handshake failed" in line for line in lines) <= 1 and len(run.stderr) < 2000, run.stderr[-2000:]
    assert lines[-1].startswith(b"exo-node: ") and b"more failed TLS handshakes" in lines[-1]
