"""`exo-node`: start a node that serves a model, alone or together with its peers."""

from __future__ import annotations

import os

# OpenBLAS worker threads spin after each call by default. A node is idle between its pipeline steps, and spinning
# then steals the cores of whatever else runs on the machine (another node on the same host); decode speed doesn't
# need the spin, so keep it minimal.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import asyncio
import dataclasses
import logging
import signal
import sys
from contextlib import AsyncExitStack

from discovery.udp import Announcement, UdpDiscovery
from node.core.placement.layer_costs import engine_head_weight
from node.core.topology import Availability
from node.fetch import startup as fetching
from node.fetch.fetcher import Fetcher
from node.fetch.follow import Follower
from node.fetch.seal import ManifestSeal
from node.grpc.client import DEFAULT_MAX_MESSAGE_BYTES, GrpcTransport, links_with, message_bound
from node.grpc.core_log import CoreLogFilter
from node.grpc.link.server import LinkServer
from node.grpc.server import GrpcServer
from node.runtime.membership import Membership
from node.runtime.node import Node
from node.runtime.settings import ServedModel
from node.security import ClusterKey, keygen_main, load_secret
from node.settings import DEMO_MODEL, GrpcSettings, HttpSettings, Machine, Settings, parse_args, settings_from_args
from node.settings.model import engine_from_args
from shards.engines.registry import engine_factory, resolve
from shards.formats.loader import load_config
from shards.formats.packaged import default_quantize, list_models

__all__ = ["DEMO_MODEL", "main", "parse_args", "run"]
log = logging.getLogger("exo-node")

CALIBRATION_WAIT_S = 30.0  # a node joins unmeasured (counted as its peers) past this: never held back for good


async def serve_api(stack: AsyncExitStack, http: HttpSettings, node: Node) -> str:
    # aiohttp and the HTTP layer load here: a node without an API (--no-api) never imports them.
    from aiohttp import web

    from node.http import logs as http_logs
    from node.http.api import Api

    # keepalive_timeout also bounds how long a client may take to send a request's headers (aiohttp arms it when the
    # connection opens and incoming bytes don't reset it): slow-header clients can't hold connections open.
    http_logs.install()  # unparseable requests: one line each, no traceback
    runner = web.AppRunner(
        Api(node, http.api).app(), handler_cancellation=True, access_log=None, keepalive_timeout=http.header_timeout
    )
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    await web.TCPSite(runner, http.host, http.port).start()
    host, port = runner.addresses[0][:2]
    return f"http://{host}:{port}"


def say_who_can_connect(grpc: GrpcSettings, key: ClusterKey | None) -> None:
    """Without a cluster key anyone who reaches the gRPC port can use the node: say so, and how to fix it."""
    if key:
        log.info(
            "cluster key %s: only nodes holding it can talk to this one (mutual TLS, signed discovery)", key.fingerprint
        )
    elif grpc.host in ("127.0.0.1", "::1", "localhost"):
        log.warning(
            "no cluster key: gRPC listens on %s only, so peers on other machines can't reach this node. "
            "For a cluster: `exo-node keygen` once, then --cluster-key-file on every node",
            grpc.host,
        )
    else:
        log.warning(
            "no cluster key: ANYONE who can reach gRPC port %s:%s can use this node and read the prompts "
            "and activations passing through it. Use `exo-node keygen` and --cluster-key-file",
            grpc.host,
            grpc.port,
        )


async def run(settings: Settings) -> int:
    """Start the parts, each once what it takes exists, then serve until a signal. Every part started is stopped
    in reverse order on the way out, also when start-up fails halfway."""
    key = load_secret(settings.security.cluster_key_file)  # the file's, else $EXO_NODE_CLUSTER_KEY's, else None
    if key:  # mutual TLS: every failed handshake is a line from gRPC's core, which anyone can cause
        CoreLogFilter().install()
    say_who_can_connect(settings.grpc, key)
    node_id, memory = settings.node.node_id, settings.node.memory_bytes
    located = fetching.locate_model(settings.model)  # (path, id) of a model here, or the id of one to fetch
    model_path, model_id = located if isinstance(located, tuple) else (None, located)
    # Engine options are vetted against a model here now; a fetched one's once it has arrived.
    engine = settings.engine
    options = {**engine.options, "quantize": default_quantize(model_id, engine.name, engine.quantize)}
    engines = engine_factory(engine.name, model_path, **options)
    tls = key.tls(node_id) if key else None  # a ValueError for a node id that cannot go in a certificate
    # The largest message a peer may send is what the model implies (a fetched model's is known only later: the
    # default then). gRPC reads a message whole before any check, so this is the bound on what a peer makes us hold.
    bound = (
        DEFAULT_MAX_MESSAGE_BYTES
        if model_path is None
        else message_bound((config := load_config(model_path)).hidden_size, config.max_position_embeddings)
    )
    head = engine_head_weight(model_path, resolve(engine.name), options["quantize"])  # a wide head costs more
    settings = dataclasses.replace(
        settings, node=dataclasses.replace(settings.node, max_tensor_bytes=bound - (1 << 20), head_weight=head)
    )
    async with AsyncExitStack() as stack:
        server = GrpcServer(settings.grpc.host, settings.grpc.port, bound, tls)  # binds now
        stack.push_async_callback(server.stop)
        address = f"{settings.grpc.advertise_host}:{server.port}"
        link = (
            LinkServer(settings.grpc.host, settings.grpc.link_port, bound, tls=tls)
            if settings.grpc.link and links_with(tls)
            else None
        )
        if link is not None:
            stack.push_async_callback(link.stop)
        transport = GrpcTransport(bound, tls=tls, links=settings.grpc.link)
        stack.push_async_callback(transport.close)
        announcement = Announcement(node_id, server.port, model_id, settings.node.engine, memory)
        discoveries = settings.discovery.discoveries(lambda: announcement, key.discovery_key() if key else None)
        board = fetching.PeerBoard()  # membership's view until the node exists
        membership = Membership(
            node_id, address, transport, discoveries, board.update, interval=settings.discovery.interval
        )
        stack.push_async_callback(membership.stop)
        fetch_counters = fetching.fetch_counters()
        seal = ManifestSeal(key.manifest_key(), node_id) if key else None  # signed manifests: with a key only
        fetcher = Fetcher(
            model_id,
            transport,
            fetching.sources_from(lambda: board.peers, model_id),
            counters=fetch_counters,
            seal=seal,
        )
        copy = None
        if model_path is None:  # a model this node doesn't have: find a peer that has it, fetch its metadata first
            await membership.start()
            copy = await fetching.open_copy(model_id, settings.fetch.models_dir, fetcher)
            model_path = copy.root
        model = ServedModel.load(model_id, model_path)
        if copy is not None and model.config.n_layers != copy.manifest.n_layers:
            raise ValueError(
                f"{model_path}: the config has {model.config.n_layers} layers, the peers' manifest "
                f"{copy.manifest.n_layers}"
            )
        source = fetching.weight_source(
            settings.fetch, model_path, model_id, model.config.n_layers, copy=copy, seal=seal
        )
        stack.callback(source.close)
        follower = Follower(copy, fetcher, fetch_counters) if copy is not None else None
        node = Node(
            settings.node,
            model,
            address=address,
            engines=engines,
            transport=transport,
            availability=follower.availability if follower is not None else Availability,
            stat_sources=[
                *(d.stats for d in discoveries if isinstance(d, UdpDiscovery)),
                fetch_counters,
                source.counters,
                *([link.counters] if link is not None else []),
            ],
            link_port=link.port if link is not None else 0,
        )
        stack.push_async_callback(node.stop)
        node.start()
        if copy is None:  # its weights are here: measure them before any peer can count this node in a plan
            await node.first_speed(CALIBRATION_WAIT_S)
        await server.start(node, source)
        if link is not None:
            await link.start(node)
        board.hand_on(node.update_peers)
        stack.callback(board.let_go)  # on the way out, the node (stopped first) hears no more
        if copy is None:
            await membership.start()
        if settings.discovery.wait_for_peers:
            await membership.wait_for_peers(settings.discovery.wait_for_peers)
        if follower is not None:  # after --wait-for-peers: the layers it is assigned depend on who is there
            stack.push_async_callback(_cancel, asyncio.create_task(follower.run(node), name="fetch-follower"))
        await node.load_pinned()
        linked = f", data link on port {link.port}" if link is not None else ""
        print(f"exo-node {node_id}: gRPC listening on {address} (model {model_id}){linked}", flush=True)
        if settings.http is not None:
            url = await serve_api(stack, settings.http, node)
            print(f"exo-node {node_id}: API listening on {url}", flush=True)
        signals = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, signals.put_nowait, sig)
        await signals.get()
        await drain(node, transport, settings.drain_timeout, signals)
    return 0


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def drain(node: Node, transport: GrpcTransport, timeout: float, signals: asyncio.Queue) -> None:
    """Leave cleanly: take no new requests, tell the peers (they plan without us at once), let the requests in flight
    finish for up to `timeout` seconds (a second signal cuts this short); whatever is left is replayed elsewhere by
    its entry node once we are gone."""
    node.start_draining()
    log.info("shutting down: draining %d requests (up to %gs)", node.status().active_requests, timeout)
    await asyncio.gather(*(transport.leave(p.address, node.id) for p in node.peers()), return_exceptions=True)
    waits = [asyncio.ensure_future(node.drained()), asyncio.ensure_future(signals.get())]
    await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for task in waits:
        task.cancel()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["keygen"]:
        return keygen_main(argv[1:])
    if argv[:1] == ["build-backend"]:  # a ggml GPU backend (shards/engines/ggml/build.py)
        from shards.engines.ggml.build import main as build_backend

        return build_backend(argv[1:])
    args = parse_args(argv)
    if args.list_models:
        print(list_models())
        return 0
    if args.list_devices:
        from shards.engines.ggml.devices import describe, devices, load_backends

        load_backends()
        print(describe(devices()))
        return 0
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = engine_from_args(args)  # a GPU node reports its GPU's memory: the machine asks for the device
        return asyncio.run(run(settings_from_args(args, machine=Machine.here(engine.name, engine.device))))
    except (ValueError, OSError) as e:  # bad model folder, bad flags, port in use: one clear line, no traceback
        print(f"exo-node: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
