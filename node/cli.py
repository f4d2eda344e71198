"""`exo-node`: start a node that serves a model, alone or together with its peers."""
from __future__ import annotations

import os

# OpenBLAS worker threads spin ~0.1 s after each call by default. A node is idle between its pipeline steps, and
# spinning then steals the cores of whatever else runs on the machine (another node on the same host measured
# 0.2x speed). Decode speed doesn't need the spin (measured equal with and without), so keep it minimal.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import argparse
import asyncio
import logging
import signal
import socket
import sys
import uuid
from contextlib import AsyncExitStack
from pathlib import Path

from aiohttp import web

from discovery.interfaces import default_advertise_host
from discovery.manual import ManualDiscovery
from discovery.static import StaticDiscovery, parse_peers
from discovery.udp import Announcement, UdpDiscovery
from shards.formats.loader import load_config
from shards.engines.registry import CHOICES, QUANTIZE_CHOICES, engine_class, engine_factory, resolve
from shards.formats.packaged import DEFAULT_MODEL, DEMO_DIR, list_models
from shards.tokenizer import Tokenizer

from node.http.api import Api, ApiSettings
from node.fetch import startup as fetching
from node.fetch.fetcher import Fetcher
from node.fetch.follow import Follower
from node.runtime.membership import Membership
from node.runtime.node import Node, NodeSettings
from node.grpc.client import DEFAULT_MAX_MESSAGE_BYTES, GrpcTransport
from node.core.scheduler import SchedulerLimits
from node.security import ClusterKey, add_key_argument, keygen_main, load_secret
from node.grpc.server import GrpcServer

log = logging.getLogger("exo-node")
DEMO_MODEL = DEMO_DIR  # the bundled demo model (--model exo-demo)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="exo-node", description="Serve a language model split across machines.")
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="a packaged model's name (see --list-models), a .gguf file, a Hugging Face model folder, or "
                         "the id of a model a peer serves, to fetch this node's layers of it from there "
                         f"(default: {DEFAULT_MODEL}, SmolLM2-135M-Instruct)")
    ap.add_argument("--list-models", action="store_true", help="list the packaged models and exit")
    ap.add_argument("--node-id", help="default: stable id derived from host name and gRPC port")
    ap.add_argument("--host", help="gRPC bind address (default: 0.0.0.0 with a cluster key; without one 127.0.0.1, "
                                   "since an open gRPC port lets anyone who reaches it use the node)")
    ap.add_argument("--advertise-host", help="address peers use to reach this node (default: --host, or the "
                                             "first non-loopback IPv4 when binding to all interfaces)")
    ap.add_argument("--grpc-port", type=int, default=50051, help="0 picks a free port (default 50051)")
    ap.add_argument("--api-host", default="127.0.0.1",
                    help="HTTP API bind address (default 127.0.0.1: local only; 0.0.0.0 to serve the LAN)")
    ap.add_argument("--api-port", type=int, default=52415, help="0 picks a free port (default 52415)")
    ap.add_argument("--no-api", action="store_true", help="no HTTP API on this node")
    ap.add_argument("--peers", default="", help="static peers' gRPC endpoints, HOST:PORT,... (with any discovery)")
    ap.add_argument("--discovery", default="udp", choices=["udp", "manual", "none"],
                    help="find peers by UDP broadcast (default), a JSON file (manual), or only --peers (none)")
    ap.add_argument("--discovery-port", type=int, default=5678, help="UDP broadcast port (default 5678)")
    ap.add_argument("--discovery-interval", type=float, default=1.0, help="seconds between announcements")
    ap.add_argument("--discovery-timeout", type=float, default=5.0,
                    help="drop a peer not heard from for this many seconds (default 5)")
    ap.add_argument("--discovery-interfaces", help="broadcast only on these interfaces (comma-separated names; "
                                                   "default: every non-loopback IPv4 interface)")
    ap.add_argument("--discovery-config", type=Path, help="--discovery manual: the JSON peers file")
    ap.add_argument("--wait-for-peers", type=int, default=0, help="print the ready lines only once N peers are known")
    ap.add_argument("--shard", help="own exactly layers START:END (half-open) instead of automatic partitioning")
    ap.add_argument("--engine", default="auto", choices=CHOICES,
                    help="ggml, numpy, tinygrad, mlx, or auto: ggml when installed, else mlx on Apple Silicon "
                         "macOS, else numpy (default)")
    ap.add_argument("--threads", type=int, help="ggml engine: compute threads (default: all cores)")
    ap.add_argument("--quantize", choices=QUANTIZE_CHOICES,
                    help="ggml engine: quantize a Hugging Face model's weights as they load (default: none)")
    ap.add_argument("--max-tokens", type=int, default=1024, help="cap on tokens generated per request")
    ap.add_argument("--memory-gb", type=float, help="memory to report for partitioning (default: available RAM)")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds without a token before failing")
    ap.add_argument("--max-replays", type=int, default=2,
                    help="replay a request on a new plan at most this often when a node of its plan is lost")
    ap.add_argument("--request-idle-timeout", type=float, default=60.0,
                    help="forget a request whose next input has not come for this many seconds (default 60)")
    ap.add_argument("--drain-timeout", type=float, default=30.0,
                    help="on SIGTERM, wait at most this long for requests in flight before exiting (default 30)")
    ap.add_argument("--max-body-kb", type=int, default=1024, help="HTTP request body size cap (default 1024 KiB)")
    ap.add_argument("--max-concurrent-requests", type=int, default=64,
                    help="requests generating at once on this entry node; more get 503 (default 64)")
    ap.add_argument("--http-timeout", type=float, default=15.0,
                    help="seconds a client may take to send a request's headers; idle connections close after it")
    ap.add_argument("--api-key", default=os.environ.get("EXO_NODE_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on the API (default: $EXO_NODE_API_KEY, else open)")
    ap.add_argument("--cors-origins", default="",
                    help="comma-separated origins allowed by CORS, or '*' (default: none, CORS off)")
    ap.add_argument("--step-tokens", type=int, default=SchedulerLimits.step_tokens,
                    help="positions one forward pass may carry (decode rows + prompt chunks, padded)")
    ap.add_argument("--max-batch-rows", type=int, default=SchedulerLimits.max_batch_rows,
                    help="decoding requests one forward pass carries; more wait their turn")
    ap.add_argument("--prefill-chunk", type=int, default=SchedulerLimits.prefill_chunk,
                    help="longest piece of a prompt prefilled in one forward pass (long prompts take several)")
    ap.add_argument("--max-stall", type=float, default=SchedulerLimits.max_stall,
                    help="while requests are decoding, a step adds only as much prompt prefill as keeps it within this "
                         "many decode steps' time (measured as it runs), so a long prompt never freezes the streams")
    ap.add_argument("--kv-memory-gb", type=float,
                    help="KV cache memory this node may reserve for requests (default: 40%% of the available memory); "
                         "a request that doesn't fit waits for room, then gets a 503")
    ap.add_argument("--queue-timeout", type=float, default=30.0,
                    help="how long a request waits for room in the cluster before a 503 (default 30 s)")
    ap.add_argument("--sample-batch-max", type=int, default=8,
                    help="last shard: sample up to this many requests' rows in one call (1 disables batching)")
    ap.add_argument("--sample-batch-window-ms", type=float, default=5.0,
                    help="last shard: close a sampling batch this long after its first row (0 disables batching)")
    add_key_argument(ap)
    fetching.add_fetch_arguments(ap)
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return ap.parse_args(argv)


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_shard(text: str | None, n_layers: int) -> tuple[int, int] | None:
    if text is None:
        return None
    start, sep, end = text.partition(":")
    if not sep or not start.isdigit() or not end.isdigit():
        raise ValueError(f"--shard must be START:END, got {text!r}")
    if not 0 <= int(start) < int(end) <= n_layers:
        raise ValueError(f"--shard {text}: need 0 <= START < END <= {n_layers} (the model's layers)")
    return int(start), int(end)


def make_discoveries(args: argparse.Namespace, announcement: Announcement, key: ClusterKey | None) -> list:
    found: list = [StaticDiscovery(parse_peers(args.peers))]
    if args.discovery == "manual":
        if args.discovery_config is None:
            raise ValueError("--discovery manual needs --discovery-config FILE")
        found.append(ManualDiscovery(args.discovery_config))
    elif args.discovery == "udp":
        interfaces = [i.strip() for i in args.discovery_interfaces.split(",")] if args.discovery_interfaces else None
        found.append(UdpDiscovery(lambda: announcement, args.discovery_port, args.discovery_interval,
                                  args.discovery_timeout, interfaces, key=key.discovery_key() if key else None))
    return found


async def serve_api(stack: AsyncExitStack, args: argparse.Namespace, node: Node) -> str:
    settings = ApiSettings(max_tokens_cap=args.max_tokens, max_body_bytes=args.max_body_kb * 1024,
                           max_concurrent=args.max_concurrent_requests, api_key=args.api_key or None,
                           cors_origins=tuple(o.strip() for o in args.cors_origins.split(",") if o.strip()))
    # keepalive_timeout also bounds how long a client may take to send a request's headers (aiohttp arms it when the
    # connection opens and incoming bytes don't reset it): slow-header clients can't hold connections open.
    runner = web.AppRunner(Api(node, settings).app(), handler_cancellation=True, access_log=None,
                           keepalive_timeout=args.http_timeout)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    await web.TCPSite(runner, args.api_host, args.api_port).start()
    host, port = runner.addresses[0][:2]
    return f"http://{host}:{port}"


def bind_host(args: argparse.Namespace, key: ClusterKey | None) -> str:
    """Where gRPC listens. Without a cluster key anyone who reaches the port can use the node, so it stays on
    loopback unless --host says otherwise, and says so."""
    host = args.host or ("0.0.0.0" if key else "127.0.0.1")
    if key:
        log.info("cluster key %s: only nodes holding it can talk to this one (mutual TLS, signed discovery)",
                 key.fingerprint)
    elif host in ("127.0.0.1", "::1", "localhost"):
        log.warning("no cluster key: gRPC listens on %s only, so peers on other machines can't reach this node. "
                    "For a cluster: `exo-node keygen` once, then --cluster-key-file on every node", host)
    else:
        log.warning("no cluster key: ANYONE who can reach gRPC port %s:%s can use this node and read the prompts "
                    "and activations passing through it. Use `exo-node keygen` and --cluster-key-file",
                    host, args.grpc_port)
    return host


async def run(args: argparse.Namespace) -> int:
    key = load_secret(args.cluster_key_file)
    host = bind_host(args, key)
    located = fetching.locate_model(args.model)  # (path, id) of a model here, or the id of one to fetch
    engine = resolve(args.engine)
    here = located[0] if isinstance(located, tuple) else None  # vetted now; a fetched model once it is here
    factory = engine_factory(engine, here, threads=args.threads, quantize=args.quantize)
    node_id = args.node_id or (
        uuid.uuid5(uuid.NAMESPACE_DNS, f"{socket.gethostname()}:{args.grpc_port}").hex[:12]
        if args.grpc_port else uuid.uuid4().hex[:12]
    )
    advertise = args.advertise_host or (host if host not in ("0.0.0.0", "::", "") else default_advertise_host())
    tls = key.tls(node_id) if key else None  # a ValueError for a node id that cannot go in a certificate
    memory = int(args.memory_gb * 2**30) if args.memory_gb is not None else available_memory()
    # Everything started below is stopped in reverse order on the way out, also when start-up fails halfway.
    async with AsyncExitStack() as stack:
        server = GrpcServer(host, args.grpc_port, DEFAULT_MAX_MESSAGE_BYTES, tls)  # binds now: our address is known
        stack.push_async_callback(server.stop)
        address = f"{advertise}:{server.port}"
        transport = GrpcTransport(DEFAULT_MAX_MESSAGE_BYTES, tls=tls)
        stack.push_async_callback(transport.close)
        model_path, model_id = located if isinstance(located, tuple) else (None, located)
        discoveries = make_discoveries(args, Announcement(node_id, server.port, model_id, engine, memory), key)
        board = fetching.PeerBoard()
        membership = Membership(node_id, address, transport, discoveries, board.update,
                                interval=args.discovery_interval)
        stack.push_async_callback(membership.stop)
        copy, fetch_counters, membership_started = None, fetching.fetch_counters(), False
        fetcher = Fetcher(model_id, transport, fetching.sources_from(lambda: board.peers, model_id), fetch_counters)
        if model_path is None:  # a model this node doesn't have: find a peer that has it, fetch its metadata first
            await membership.start()
            membership_started = True
            copy = await fetching.open_copy(model_id, args.models_dir, fetcher)
            model_path = copy.root
        config = load_config(model_path)
        tokenizer = Tokenizer.load(model_path)
        if copy is not None and config.n_layers != copy.manifest.n_layers:
            raise ValueError(f"{model_path}: the config has {config.n_layers} layers, the peers' manifest "
                             f"{copy.manifest.n_layers}")
        pinned = parse_shard(args.shard, config.n_layers)
        settings = NodeSettings(node_id=node_id, model_dir=model_path, model_id=model_id,
                                address=address, memory_bytes=memory, engine=engine,
                                pinned=pinned, max_tensor_bytes=DEFAULT_MAX_MESSAGE_BYTES - (1 << 20),
                                request_timeout=args.request_timeout, sample_batch_max=args.sample_batch_max,
                                sample_batch_window_ms=args.sample_batch_window_ms, max_replays=args.max_replays,
                                request_idle_timeout=args.request_idle_timeout, queue_timeout=args.queue_timeout,
                                kv_budget=int((args.kv_memory_gb * 2**30) if args.kv_memory_gb is not None
                                              else 0.4 * available_memory()),
                                kv_value_bytes=engine_class(engine).kv_value_bytes,
                                scheduling=SchedulerLimits(args.step_tokens, args.max_batch_rows, args.prefill_chunk,
                                                           engine_class(engine).prefill_buckets, args.max_stall))
        source = fetching.weight_source(args, model_path, model_id, config.n_layers, copy)
        stack.callback(source.close)
        node = Node(settings, config, tokenizer, factory, transport,
                    stat_sources=[*(d.stats for d in discoveries if isinstance(d, UdpDiscovery)), fetch_counters,
                                  source.counters])
        stack.push_async_callback(node.stop)
        follower = Follower(node, copy, fetcher, fetch_counters) if copy is not None else None
        node.start()
        await server.start(node, source)
        board.hand_on(node.update_peers)
        stack.callback(setattr, board, "forward", None)  # on the way out, the node (stopped first) hears no more
        if not membership_started:
            await membership.start()
        if args.wait_for_peers:
            await membership.wait_for_peers(args.wait_for_peers)
        if follower is not None:  # after --wait-for-peers: the layers it is assigned depend on who is there
            stack.push_async_callback(_cancel, asyncio.create_task(follower.run(), name="fetch-follower"))
        if pinned is not None and node.availability().can_serve(node.make_pinned_shard()):
            await node.shards.get(node.make_pinned_shard())  # a pinned node knows its shard: load it now
        print(f"exo-node {node_id}: gRPC listening on {settings.address} (model {settings.model_id})", flush=True)
        if not args.no_api:
            url = await serve_api(stack, args, node)
            print(f"exo-node {node_id}: API listening on {url}", flush=True)
        signals = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, signals.put_nowait, sig)
        await signals.get()
        await drain(node, transport, args.drain_timeout, signals)
    return 0


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def drain(node: Node, transport: GrpcTransport, timeout: float, signals: asyncio.Queue) -> None:
    """Leave cleanly: take no new requests, tell the peers (they plan without us at once), let the requests in flight
    finish for up to `timeout` seconds (a second signal cuts this short); whatever is left is replayed elsewhere by
    its entry node once we are gone."""
    node.start_draining()
    log.info("shutting down: draining %d requests (up to %gs)", node.core.active + node.entry.active, timeout)
    await asyncio.gather(*(transport.leave(p.address, node.id) for p in list(node.peers.values())),
                         return_exceptions=True)
    waits = [asyncio.ensure_future(node.drained()), asyncio.ensure_future(signals.get())]
    await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for task in waits:
        task.cancel()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["keygen"]:
        return keygen_main(argv[1:])
    args = parse_args(argv)
    if args.list_models:
        print(list_models())
        return 0
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(run(args))
    except (ValueError, OSError) as e:  # bad model folder, bad flags, port in use: one clear line, no traceback
        print(f"exo-node: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
