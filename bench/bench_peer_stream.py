"""CPU per message of the data path's stream (node/grpc/stream.py's PeerStream), one message at a time as a
one-stream ring sends them: what the sending node's event loop spends on gRPC per hop, apart from everything else a
node does.

    uv run python -m bench.bench_peer_stream [--messages 3000] [--rounds 3] [--core 0]

A peer process answers every message at once (an empty answer, as a node that refuses nothing); this process
sends `--messages` messages, each after the last one's answer, and reports its own thread's CPU time per message
(time.thread_time: what the loop did, not what it waited) and the wall time per round trip. Both processes run on
`--core` (a one-core machine, where every microsecond of the loop is one the engine doesn't get).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import grpc

from bench.local_cluster import free_port
from node.grpc.client import channel_options
from node.grpc.generated import node_service_pb2 as pb
from node.grpc.generated import node_service_pb2_grpc as pb_grpc
from node.grpc.stream import PeerStream

WARMUP = 200


class Peer(pb_grpc.NodeServiceServicer):
    async def SendStream(self, requests, context):
        async for _ in requests:
            yield pb.SendResponse()


async def serve(port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_NodeServiceServicer_to_server(Peer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def send(port: int, n: int) -> dict:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options(1 << 20))
    stub = pb_grpc.NodeServiceStub(channel)
    stream = PeerStream(lambda: stub.SendStream(wait_for_ready=True), 10.0)
    message = pb.SendRequest(entries=[pb.TensorEntry(request_id="r")])
    for _ in range(WARMUP):
        await stream.send(message)
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(n):
        await stream.send(message)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    await stream.close()
    await channel.close()
    return {"messages": n, "cpu_us_per_message": round(cpu / n * 1e6, 1), "wall_us_per_message": round(wall / n * 1e6)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--core", type=int, default=0, help="the core both processes run on")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the peer process
    args = ap.parse_args()
    if args.serve is not None:
        asyncio.run(serve(args.serve))
        return
    os.sched_setaffinity(0, {args.core})
    port = free_port()
    peer = subprocess.Popen([sys.executable, "-m", "bench.bench_peer_stream", "--serve", str(port)])
    try:
        for r in range(args.rounds):
            print(json.dumps({"round": r, **asyncio.run(send(port, args.messages))}), flush=True)
    finally:
        peer.kill()
        peer.wait()


if __name__ == "__main__":
    main()
