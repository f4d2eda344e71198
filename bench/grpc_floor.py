"""The floor under a hop: gRPC's own one-way time for the ring's message, between two bare processes on this
machine (no node, no core, no engine), as bench_overhead's `--only floor` reports it.

One process serves the data path's stream (`SendStream`) and stamps when each message reaches its handler; the
other writes the message a decode step sends (one row of activations) and reads the stamp back. perf_counter is
CLOCK_MONOTONIC on Linux, one clock for every process, so the difference is the one-way time: what a hop costs
before any of the node's own work. A pause between messages lets both sides go idle, as a ring's nodes do while
the other computes.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time

import grpc
import numpy as np

from node.core.requests import Activation
from node.grpc import wire
from node.grpc.generated import node_service_pb2 as pb
from node.grpc.generated import node_service_pb2_grpc as pb_grpc


class _Stamps(pb_grpc.NodeServiceServicer):
    async def SendStream(self, requests, context):
        async for request in requests:
            received = time.perf_counter()
            wire.decode_send(request, 1 << 24)  # the node's own decoding
            yield pb.SendResponse(rejected=[pb.Rejected(request_id=repr(received))])


async def _serve(port: int) -> None:
    server = grpc.aio.server()
    server.add_insecure_port(f"127.0.0.1:{port}")
    pb_grpc.add_NodeServiceServicer_to_server(_Stamps(), server)
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def _one_way(port: int, hidden: int, messages: int, pause: float) -> list[float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.NodeServiceStub(channel).SendStream()
        row = Activation("r", np.zeros((1, hidden), np.float32))
        times = []
        for _ in range(messages):
            await asyncio.sleep(pause)
            message = wire.encode_send((row,), ())  # encoding is the node's side of the hop (`hop_write`)
            started = time.perf_counter()
            await call.write(message)
            answer = await call.read()
            times.append(float(answer.rejected[0].request_id) - started)
        call.cancel()
        return times


def measure(port: int, hidden: int = 576, messages: int = 400, pause: float = 0.005, pinned: bool = False) -> dict:
    """Median and 90th percentile of the one-way time in ms (`hidden`: the model's width; SmolLM2's is 576);
    `pinned`: the writer on core 0 and the server on core 1, each process's threads on its core only."""
    own = os.sched_getaffinity(0)
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.grpc_floor", str(port)],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=(lambda: os.sched_setaffinity(0, {1})) if pinned else None,
    )
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("the floor's server did not start")
        if pinned:
            os.sched_setaffinity(0, {0})
        times = sorted(asyncio.run(_one_way(port, hidden, messages, pause))[messages // 10 :])  # after warming up
    finally:
        os.sched_setaffinity(0, own)
        server.terminate()
        server.wait(10)
    return {
        "one_way_ms_median": round(statistics.median(times) * 1e3, 3),
        "one_way_ms_p90": round(times[int(len(times) * 0.9)] * 1e3, 3),
        "bytes": wire.encode_send((Activation("r", np.zeros((1, hidden), np.float32)),), ()).ByteSize(),
    }


if __name__ == "__main__":
    asyncio.run(_serve(int(sys.argv[1])))
