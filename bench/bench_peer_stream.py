"""CPU per message of the data path's stream (node/grpc/stream.py's PeerStream), one message at a time as a
one-stream ring sends them: what a hop costs the two nodes' processes in gRPC, apart from everything else a node does.

    uv run python -m bench.bench_peer_stream [--messages 2000] [--rounds 3] [--gap-ms 5]

A peer process answers as a node does (node/grpc/server.py: a quiet message only when it refuses something, here
nothing). This process sends `--messages` messages `--gap-ms` apart (a token's compute between hops), each round
both ways in turn: `asked`, every message awaiting its answer (the stream before quiet messages), and `quiet`
(`post`: the way the pipeline sends now). Reported: CPU per message of each process, every thread (the kernel's
schedstat: gRPC's own threads count, the gap's timer too, alike in both ways), and the peer's answers per message.
The sender runs on `--core`, the peer on `--peer-core` (two machines).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc

from bench.local_cluster import free_port
from node.grpc.client import channel_options
from node.grpc.generated import node_service_pb2 as pb
from node.grpc.generated import node_service_pb2_grpc as pb_grpc
from node.grpc.stream import PeerStream

WARMUP = 200


class Peer(pb_grpc.NodeServiceServicer):
    async def SendStream(self, requests, context):
        async for request in requests:
            if not request.quiet:
                yield pb.SendResponse(seq=request.seq)


async def serve(port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_NodeServiceServicer_to_server(Peer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def process_cpu_ns(pid: int) -> int:
    """Nanoseconds every thread of `pid` has been on a CPU (threads that ended meanwhile are not counted)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError):
            continue
    return total


async def send(port: int, peer: int, n: int, gap: float, quiet: bool) -> dict:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options(1 << 20))
    stub = pb_grpc.NodeServiceStub(channel)
    stream = PeerStream(lambda: stub.SendStream(wait_for_ready=True), 10.0)
    message = pb.SendRequest(entries=[pb.TensorEntry(request_id="r", tensor=pb.Tensor(data=bytes(576 * 4)))])
    answered = []

    async def one() -> None:
        if quiet:
            await stream.post(message, answered.append)
        else:
            answered.append(await stream.send(message))
        await asyncio.sleep(gap)

    for _ in range(WARMUP):
        await one()
    me, them, answers = process_cpu_ns(os.getpid()), process_cpu_ns(peer), len(answered)
    for _ in range(n):
        await one()
    me, them = process_cpu_ns(os.getpid()) - me, process_cpu_ns(peer) - them
    await asyncio.sleep(1.5)  # past ask_every: every quiet message answered
    peer_answers = sum(a is not None for a in answered[answers:])
    await stream.close()
    await channel.close()
    return {
        "way": "quiet" if quiet else "asked",
        "messages": n,
        "sender_cpu_us": round(me / n / 1e3, 1),
        "peer_cpu_us": round(them / n / 1e3, 1),
        "both_cpu_us": round((me + them) / n / 1e3, 1),
        "answers_per_message": round(peer_answers / n, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gap-ms", type=float, default=5.0, help="between messages (a token's compute)")
    ap.add_argument("--core", type=int, default=0, help="the sender's core")
    ap.add_argument("--peer-core", type=int, default=1, help="the peer's core")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the peer process
    args = ap.parse_args()
    if args.serve is not None:
        asyncio.run(serve(args.serve))
        return
    os.sched_setaffinity(0, {args.core})
    port = free_port()
    peer = subprocess.Popen([sys.executable, "-m", "bench.bench_peer_stream", "--serve", str(port)])
    os.sched_setaffinity(peer.pid, {args.peer_core})
    try:
        for r in range(args.rounds):
            for quiet in (r % 2 == 1, r % 2 == 0):  # alternated: asked first in even rounds
                got = asyncio.run(send(port, peer.pid, args.messages, args.gap_ms / 1e3, quiet))
                print(json.dumps({"round": r, **got}), flush=True)
    finally:
        peer.kill()
        peer.wait()


if __name__ == "__main__":
    main()
