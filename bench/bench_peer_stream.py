"""CPU per message of the data path, one message at a time as a one-stream ring sends them: on gRPC's stream
(node/grpc/stream.py's PeerStream) and on the data link (node/grpc/link/), alternating rounds. What the sending
node's event loop spends per hop, apart from everything else a node does.

    uv run python -m bench.bench_peer_stream [--messages 3000] [--rounds 3] [--core 0] [--paths grpc,link] [--tls]

A peer process takes every message as a node does (node/grpc/server.py's `take_send`: decoded and validated, a
node that refuses nothing) and answers at once; this process sends `--messages` messages (one activation row of
SmolLM2's width, 576 floats), each after the last one's answer, and reports its own thread's CPU time per message
(time.thread_time: what the loop did, not what it waited) and the wall time per round trip. Both processes run on
`--core` (a one-core machine, where every microsecond of the loop is one the engine doesn't get). With `--tls`
both paths are a cluster key's mutual TLS (gRPC's channel credentials; the link's `ssl_context`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from bench.local_cluster import free_port
from node.core.requests import Activation
from node.grpc import wire
from node.grpc.client import channel_options
from node.grpc.generated import node_service_pb2_grpc as pb_grpc
from node.grpc.link.client import LinkConnection
from node.grpc.link.server import LinkServer
from node.grpc.server import NodeServicer
from node.grpc.stream import PeerStream
from node.security import read_key_file, write_key_file

WARMUP = 200


class Peer:
    """A node that takes every message and refuses nothing (the servers' `Handler`)."""

    max_tensor_bytes = 1 << 20

    def accept_activations(self, activations, caller, *, received=None):
        return []

    def accept_tokens(self, message, caller):
        pass

    def relay_row(self, request_id, data, caller, received):  # no engine thread waits: the general way
        return False

    def would_relay(self, request_id, data, caller):
        return False

    def warm_with(self, warm):
        pass


async def serve(port: int, link_port: int, key: Path | None) -> None:
    tls = read_key_file(key).tls("peer") if key else None
    server = grpc.aio.server()
    pb_grpc.add_NodeServiceServicer_to_server(NodeServicer(Peer()), server)
    if tls:
        server.add_secure_port(f"127.0.0.1:{port}", tls.server_credentials())
    else:
        server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    link = LinkServer("127.0.0.1", link_port, 1 << 20, tls=tls)
    await link.start(Peer())
    await server.wait_for_termination()


async def send(path: str, port: int, link_port: int, n: int, key: Path | None) -> dict:
    message = wire.encode_send((Activation("r", np.zeros((1, 576), np.float32)),), ())
    tls = read_key_file(key).tls("sender") if key else None
    if path == "grpc":
        options = channel_options(1 << 20)
        channel = (
            grpc.aio.secure_channel(f"127.0.0.1:{port}", tls.channel_credentials(), options + tls.channel_options())
            if tls
            else grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
        )
        stub = pb_grpc.NodeServiceStub(channel)
        stream = PeerStream(lambda: stub.SendStream(wait_for_ready=True), 10.0)
    else:
        context = tls.ssl_context(server=False) if tls else None
        stream = await LinkConnection.open("127.0.0.1", link_port, 1 << 20, 10.0, context)
    for _ in range(WARMUP):
        await stream.send(message)
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(n):
        await stream.send(message)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    if path == "grpc":
        await stream.close()
        await channel.close()
    else:
        stream.close()
    return {"messages": n, "cpu_us_per_message": round(cpu / n * 1e6, 1), "wall_us_per_message": round(wall / n * 1e6)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--core", type=int, default=0, help="the core both processes run on")
    ap.add_argument("--paths", default="grpc,link", help="grpc: gRPC's stream; link: the data link")
    ap.add_argument("--tls", action="store_true", help="both paths with a cluster key: mutual TLS")
    ap.add_argument("--serve", type=int, nargs=2, default=None, help=argparse.SUPPRESS)  # the peer process
    ap.add_argument("--key", type=Path, default=None, help=argparse.SUPPRESS)  # the peer's key file
    args = ap.parse_args()
    if args.serve is not None:
        asyncio.run(serve(*args.serve, args.key))
        return
    os.sched_setaffinity(0, {args.core})
    port, link_port = free_port(), free_port()
    folder = tempfile.TemporaryDirectory()
    key = Path(folder.name) / "cluster.key" if args.tls else None
    if key:
        write_key_file(key)
    cmd = [
        sys.executable,
        "-m",
        "bench.bench_peer_stream",
        "--core",
        str(args.core),
        "--serve",
        str(port),
        str(link_port),
        *(["--key", str(key)] if key else []),
    ]
    peer = subprocess.Popen(cmd)
    paths = args.paths.split(",")
    try:
        time.sleep(2)  # the peer's servers start
        for r in range(args.rounds):
            for path in paths if r % 2 == 0 else paths[::-1]:
                got = asyncio.run(send(path, port, link_port, args.messages, key))
                print(json.dumps({"path": path, "tls": args.tls, "round": r, **got}), flush=True)
    finally:
        peer.kill()
        peer.wait()
        folder.cleanup()


if __name__ == "__main__":
    main()
