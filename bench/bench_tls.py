"""What mutual TLS costs on loopback: small messages on a stream, new connections, and bulk activations.

    uv run python -m bench.bench_tls [--calls 2000] [--repeats 3]

Each figure is plaintext vs mTLS (the cluster-key credentials), median of the interleaved repeats, one client and one server
in this process (as two nodes on one host would run, minus the second interpreter).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import grpc

from node.grpc.client import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from node.grpc.generated import node_service_pb2 as pb
from node.grpc.generated import node_service_pb2_grpc as pb_grpc
from node.security import ClusterKey, generate_secret


class Sink(pb_grpc.NodeServiceServicer):
    async def SendStream(self, requests, context):
        async for _ in requests:
            yield pb.SendResponse()

    async def HealthCheck(self, request, context):
        return pb.HealthCheckResponse(ok=True)


def result_message() -> pb.SendRequest:
    """The size of a streamed token: one id, a logprob, a 32-hex request id."""
    return pb.SendRequest(
        results=[
            pb.SendResultRequest(
                request_id="0123456789abcdef0123456789abcdef", tokens=[pb.TokenResult(token=31337, logprob=-0.25)]
            )
        ]
    )


def tensor_message(mib: int) -> pb.SendRequest:
    data = bytes(mib << 20)  # float32 activations, e.g. 256 tokens x 4096 hidden = 4 MiB
    return pb.SendRequest(
        entries=[
            pb.TensorEntry(
                request_id="r", tensor=pb.Tensor(data=data, shape=[len(data) // 16384, 4096], dtype="float32")
            )
        ]
    )


class Pair:
    """A server and a way to open channels to it, plaintext or mTLS."""

    def __init__(self, key: ClusterKey | None):
        self.key = key
        self.options = channel_options(DEFAULT_MAX_MESSAGE_BYTES)

    async def __aenter__(self) -> Pair:
        self.server = grpc.aio.server(options=self.options)
        pb_grpc.add_NodeServiceServicer_to_server(Sink(), self.server)
        address = "127.0.0.1:0"
        port = (
            self.server.add_secure_port(address, self.key.server_credentials("server"))
            if self.key
            else self.server.add_insecure_port(address)
        )
        self.address = f"127.0.0.1:{port}"
        await self.server.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.stop(None)

    def channel(self) -> grpc.aio.Channel:
        if self.key is None:
            return grpc.aio.insecure_channel(self.address, options=self.options)
        return grpc.aio.secure_channel(
            self.address, self.key.channel_credentials("client"), options=self.options + self.key.channel_options()
        )


async def timed(n: int, call: Callable[[], Awaitable]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads) per call, over n sequential calls after a
    warm-up. CPU time is the steadier figure on a shared machine: other processes' load inflates wall time only."""
    for _ in range(min(50, n)):
        await call()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        await call()
    return (time.perf_counter() - wall) / n, (time.process_time() - cpu) / n


async def on_a_stream(pair: Pair, n: int, msg: pb.SendRequest) -> tuple[float, float]:
    """n messages, each awaiting its answer, on one long-lived SendStream (the data path)."""
    channel = pair.channel()
    call = pb_grpc.NodeServiceStub(channel).SendStream()

    async def one():
        await call.write(msg)
        return await call.read()

    try:
        return await timed(n, one)
    finally:
        call.cancel()
        await channel.close()


async def small_calls(pair: Pair, n: int) -> tuple[float, float]:
    return await on_a_stream(pair, n, result_message())


async def new_connections(pair: Pair, n: int) -> tuple[float, float]:
    async def connect_and_call():
        channel = pair.channel()
        try:
            await pb_grpc.NodeServiceStub(channel).HealthCheck(pb.HealthCheckRequest(), timeout=10)
        finally:
            await channel.close()

    return await timed(n, connect_and_call)


async def bulk(pair: Pair, n: int, mib: int) -> tuple[float, float]:
    return await on_a_stream(pair, n, tensor_message(mib))


async def measure(calls: int, repeats: int) -> None:
    key = ClusterKey(generate_secret())
    rows = [
        ("SendResult-sized message", lambda p: small_calls(p, calls), f"{calls} sequential calls"),
        ("new connection + HealthCheck", lambda p: new_connections(p, 100), "100 fresh channels"),
        ("4 MiB activations", lambda p: bulk(p, 20, 4), "20 sequential calls"),
    ]
    print(f"{'':30} {'plaintext wall / CPU':>22} {'mTLS wall / CPU':>22} {'extra CPU':>10}")
    for name, run, what in rows:
        samples: dict[str, list[tuple[float, float]]] = {"plain": [], "tls": []}
        for _ in range(repeats):  # interleaved, so drift in the machine's load hits both alike
            for label, k in (("plain", None), ("tls", key)):
                async with Pair(k) as pair:
                    samples[label].append(await run(pair))
        ms = {label: [statistics.median(x[i] for x in s) * 1000 for i in (0, 1)] for label, s in samples.items()}
        (pw, pc), (tw, tc) = ms["plain"], ms["tls"]
        print(f"{name:30} {pw:8.3f} / {pc:7.3f} ms {tw:8.3f} / {tc:7.3f} ms {tc - pc:+8.3f} ms  ({what})")


def cluster_decode(rounds: int, tokens: int, engine: str) -> None:
    """One greedy stream of SmolLM2 through 3 nodes on loopback (10 layers each), with and without a cluster key,
    interleaved rounds: decode tok/s of each, and the cost of TLS."""
    import tempfile
    from pathlib import Path

    from bench.bench_cluster import decode_rate, stream_stamps
    from bench.local_cluster import Cluster
    from node.security import write_key_file

    with tempfile.TemporaryDirectory() as tmp:
        key_file = Path(tmp) / "k"
        write_key_file(key_file)
        rates: dict[str, list[float]] = {"plaintext": [], "mutual TLS": []}
        for _ in range(rounds):
            for label, extra in (("plaintext", []), ("mutual TLS", ["--cluster-key-file", str(key_file)])):
                with Cluster(
                    Path("smollm2"),
                    3,
                    shards=["0:10", "10:20", "20:30"],
                    api_nodes=1,
                    model_id="smollm2-135m-instruct",
                    engine=engine,
                    extra=[*(["--threads", "1"] if engine == "ggml" else []), *extra],
                ) as c:
                    url = c.nodes[0].api_url
                    stream_stamps(url, "smollm2-135m-instruct", "warm up", 4)
                    rates[label].append(
                        decode_rate(stream_stamps(url, "smollm2-135m-instruct", "Tell me about the sea.", tokens))
                    )
    plain, tls = (statistics.median(rates[k]) for k in ("plaintext", "mutual TLS"))
    print(
        f"{engine}, 3 nodes, one stream: plaintext {plain:.1f} tok/s, mutual TLS {tls:.1f} tok/s "
        f"({100 * (plain - tls) / plain:+.1f}% slower); rounds: {rates}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--cluster",
        action="store_true",
        help="instead: decode speed of one stream through 3 nodes, with and without a key",
    )
    ap.add_argument("--engine", default="numpy", help="with --cluster (ggml: one thread per node)")
    args = ap.parse_args()
    if args.cluster:
        cluster_decode(args.repeats, 64, args.engine)
    else:
        asyncio.run(measure(args.calls, args.repeats))


if __name__ == "__main__":
    main()
