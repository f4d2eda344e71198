"""Everything `exo-node` is told, from its flags: `parse_args`, then `settings_from_args`, which turns them into the
settings objects the parts take, pure (the facts it needs of the machine are handed to it), so what a flag does can
be checked without starting anything (tests/unit/test_settings.py). node/cli.py wires the parts with them.

Flags of their own modules are declared and read there: the cluster key (node/security), fetching (node/fetch/
startup.py), discovery (node/cli.py's `make_discoveries`).
"""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from discovery.interfaces import default_advertise_host
from node.core.admission import CoreLimits
from node.core.scheduler import SchedulerLimits
from node.core.speculation import SpeculationLimits
from node.fetch import startup as fetching
from node.grpc.client import DEFAULT_MAX_MESSAGE_BYTES
from node.http.api import ApiSettings
from node.runtime.settings import SPECULATE_CHOICES, NodeSettings
from node.security import add_key_argument
from shards.engines.registry import CHOICES, FLOAT_MATMUL_CHOICES, QUANTIZE_CHOICES, engine_class, resolve
from shards.formats.packaged import DEFAULT_MODEL, DEMO_DIR

DEMO_MODEL = DEMO_DIR  # the bundled demo model (--model exo-demo)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="exo-node", description="Serve a language model split across machines.")
    ap.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="a packaged model's name (see --list-models), a .gguf file, a Hugging Face model folder, or "
        "the id of a model a peer serves, to fetch this node's layers of it from there "
        f"(default: {DEFAULT_MODEL}, SmolLM2-135M-Instruct)",
    )
    ap.add_argument("--list-models", action="store_true", help="list the packaged models and exit")
    ap.add_argument("--node-id", help="default: stable id derived from host name and gRPC port")
    ap.add_argument(
        "--host",
        help="gRPC bind address (default: 0.0.0.0 with a cluster key; without one 127.0.0.1, "
        "since an open gRPC port lets anyone who reaches it use the node)",
    )
    ap.add_argument(
        "--advertise-host",
        help="address peers use to reach this node (default: --host, or the "
        "first non-loopback IPv4 when binding to all interfaces)",
    )
    ap.add_argument("--grpc-port", type=int, default=50051, help="0 picks a free port (default 50051)")
    ap.add_argument(
        "--api-host",
        default="127.0.0.1",
        help="HTTP API bind address (default 127.0.0.1: local only; 0.0.0.0 to serve the LAN)",
    )
    ap.add_argument("--api-port", type=int, default=52415, help="0 picks a free port (default 52415)")
    ap.add_argument("--no-api", action="store_true", help="no HTTP API on this node")
    ap.add_argument("--peers", default="", help="static peers' gRPC endpoints, HOST:PORT,... (with any discovery)")
    ap.add_argument(
        "--discovery",
        default="udp",
        choices=["udp", "manual", "none"],
        help="find peers by UDP broadcast (default), a JSON file (manual), or only --peers (none)",
    )
    ap.add_argument("--discovery-port", type=int, default=5678, help="UDP broadcast port (default 5678)")
    ap.add_argument("--discovery-interval", type=float, default=1.0, help="seconds between announcements")
    ap.add_argument(
        "--discovery-timeout",
        type=float,
        default=5.0,
        help="drop a peer not heard from for this many seconds (default 5)",
    )
    ap.add_argument(
        "--discovery-interfaces",
        help="broadcast only on these interfaces (comma-separated names; default: every non-loopback IPv4 interface)",
    )
    ap.add_argument("--discovery-config", type=Path, help="--discovery manual: the JSON peers file")
    ap.add_argument("--wait-for-peers", type=int, default=0, help="print the ready lines only once N peers are known")
    ap.add_argument("--shard", help="own exactly layers START:END (half-open) instead of automatic partitioning")
    ap.add_argument(
        "--engine",
        default="auto",
        choices=CHOICES,
        help="ggml, numpy, tinygrad, mlx, or auto: ggml when installed, else mlx on Apple Silicon "
        "macOS, else numpy (default)",
    )
    ap.add_argument("--threads", type=int, help="ggml engine: compute threads (default: all cores)")
    ap.add_argument(
        "--quantize",
        choices=QUANTIZE_CHOICES,
        help="ggml engine: quantize a model's weight matrices as they load, a Hugging Face model's or "
        "a GGUF's (default: none, except the packaged smollm2: f16)",
    )
    ap.add_argument(
        "--float-matmul",
        choices=FLOAT_MATMUL_CHOICES,
        help="ggml engine, F16/F32 weights: pad (default: batch-invariant, exact replay; 1-row steps cost more), "
        "rowwise (batch-invariant; prefill and batches cost more), fast (not batch-invariant): docs/operations.md",
    )
    ap.add_argument("--max-tokens", type=int, default=1024, help="cap on tokens generated per request")
    ap.add_argument("--memory-gb", type=float, help="memory to report for partitioning (default: available RAM)")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds without a token before failing")
    ap.add_argument(
        "--max-replays",
        type=int,
        default=2,
        help="replay a request on a new plan at most this often when a node of its plan is lost",
    )
    ap.add_argument(
        "--request-idle-timeout",
        type=float,
        default=60.0,
        help="forget a request whose next input has not come for this many seconds (default 60)",
    )
    ap.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, wait at most this long for requests in flight before exiting (default 30)",
    )
    ap.add_argument("--max-body-kb", type=int, default=1024, help="HTTP request body size cap (default 1024 KiB)")
    ap.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=64,
        help="requests generating at once on this entry node; more get 503 (default 64)",
    )
    ap.add_argument(
        "--http-timeout",
        type=float,
        default=15.0,
        help="seconds a client may take to send a request's headers; idle connections close after it",
    )
    ap.add_argument(
        "--api-key",
        default=os.environ.get("EXO_NODE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on the API (default: $EXO_NODE_API_KEY, else open)",
    )
    ap.add_argument(
        "--cors-origins", default="", help="comma-separated origins allowed by CORS, or '*' (default: none, CORS off)"
    )
    ap.add_argument(
        "--step-tokens",
        type=int,
        default=SchedulerLimits.step_tokens,
        help="positions one forward pass may carry (decode rows + prompt chunks, padded)",
    )
    ap.add_argument(
        "--max-batch-rows",
        type=int,
        default=SchedulerLimits.max_batch_rows,
        help="decoding requests one forward pass carries; more wait their turn",
    )
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        default=SchedulerLimits.prefill_chunk,
        help="longest piece of a prompt prefilled in one forward pass (long prompts take several)",
    )
    ap.add_argument(
        "--max-stall",
        type=float,
        default=SchedulerLimits.max_stall,
        help="while requests are decoding, a step adds only as much prompt prefill as keeps it within this "
        "many decode steps' time (measured as it runs), so a long prompt never freezes the streams",
    )
    ap.add_argument(
        "--micro-batches",
        type=int,
        default=SchedulerLimits.micro_batches,
        help="on a ring of several nodes, split the decoding requests in this many batches that follow each other "
        "round the ring, so every node computes at once (default 0: one per node of the ring; 1: one batch)",
    )
    ap.add_argument(
        "--kv-memory-gb",
        type=float,
        help="KV cache memory this node may reserve for requests (default: 40%% of the available memory); "
        "a request that doesn't fit waits for room, then gets a 503",
    )
    ap.add_argument(
        "--kv-entry-share",
        type=float,
        default=0.5,
        help="of that memory, the most the requests of one other entry node may reserve together "
        "(default 0.5): a peer can't take it all; this node's own requests are not limited",
    )
    ap.add_argument(
        "--queue-timeout",
        type=float,
        default=30.0,
        help="how long a request waits for room in the cluster before a 503 (default 30 s)",
    )
    ap.add_argument(
        "--sample-batch-max",
        type=int,
        default=8,
        help="last shard: sample up to this many requests' rows in one call (1 disables batching)",
    )
    ap.add_argument(
        "--sample-batch-window-ms",
        type=float,
        default=5.0,
        help="last shard: close a sampling batch this long after its first row (0 disables batching)",
    )
    ap.add_argument(
        "--speculate",
        choices=SPECULATE_CHOICES,
        default="lookup",
        help="speculative decoding as a request's first node: propose tokens by prompt lookup (default), with a "
        "draft model (--draft-model), or not at all; the last node verifies them, the output is the same",
    )
    ap.add_argument(
        "--speculate-tokens",
        type=int,
        default=SpeculationLimits.max_drafts,
        help=f"the most tokens proposed per step of a request (default {SpeculationLimits.max_drafts}; fewer "
        "while they are rejected)",
    )
    ap.add_argument(
        "--speculate-max-requests",
        type=int,
        default=SpeculationLimits.max_requests,
        help=f"propose only while this node holds at most this many requests (default "
        f"{SpeculationLimits.max_requests}: beside many decoding requests, draft rows cost the batch compute)",
    )
    ap.add_argument(
        "--draft-model",
        type=Path,
        help="with --speculate draft: a small model (GGUF file or folder) with the same tokenizer",
    )
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


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """--shard START:END (half-open). That END is within the model's layers is checked once the model is loaded."""
    if text is None:
        return None
    start, sep, end = text.partition(":")
    if not sep or not start.isdigit() or not end.isdigit():
        raise ValueError(f"--shard must be START:END, got {text!r}")
    if not int(start) < int(end):
        raise ValueError(f"--shard {text}: need START < END")
    return int(start), int(end)


@dataclass(frozen=True)
class Machine:
    """What settings depend on that is a fact of this machine, not a flag: read once by `Machine.here()`."""

    hostname: str
    available_memory: int  # bytes
    lan_host: str  # the address other machines most likely reach us at

    @classmethod
    def here(cls) -> Machine:
        return cls(socket.gethostname(), available_memory(), default_advertise_host())


@dataclass(frozen=True)
class GrpcSettings:
    """Where the gRPC server listens, and the host peers reach it at (the port is the one it gets)."""

    host: str
    port: int  # 0: a free port
    advertise_host: str


@dataclass(frozen=True)
class HttpSettings:
    """Where the HTTP API listens, and what it allows (None in `Settings`: --no-api)."""

    host: str
    port: int  # 0: a free port
    header_timeout: float  # seconds a client may take to send a request's headers; idle connections close after it
    api: ApiSettings


@dataclass(frozen=True)
class Settings:
    node: NodeSettings
    grpc: GrpcSettings
    http: HttpSettings | None
    drain_timeout: float  # on SIGTERM, wait at most this long for requests in flight


def settings_from_args(args: argparse.Namespace, *, keyed: bool, machine: Machine) -> Settings:
    """The settings every part takes, from the flags. `keyed`: a cluster key was given (gRPC then listens on every
    interface unless --host says otherwise; without one, on loopback only, since an open port lets anyone who
    reaches it use the node)."""
    host = args.host or ("0.0.0.0" if keyed else "127.0.0.1")
    node_id = args.node_id or (
        uuid.uuid5(uuid.NAMESPACE_DNS, f"{machine.hostname}:{args.grpc_port}").hex[:12]
        if args.grpc_port
        else uuid.uuid4().hex[:12]
    )
    engine = resolve(args.engine)
    kind = engine_class(engine)
    kv_budget = int(args.kv_memory_gb * 2**30) if args.kv_memory_gb is not None else int(0.4 * machine.available_memory)
    if not 0 < args.kv_entry_share <= 1:
        raise ValueError(f"--kv-entry-share must be in (0, 1], got {args.kv_entry_share}")
    if args.micro_batches < 0:
        raise ValueError(f"--micro-batches must be 0 (one per node of the ring) or more, got {args.micro_batches}")
    node = NodeSettings(
        node_id=node_id,
        memory_bytes=int(args.memory_gb * 2**30) if args.memory_gb is not None else machine.available_memory,
        engine=engine,
        pinned=parse_shard(args.shard),
        max_tensor_bytes=DEFAULT_MAX_MESSAGE_BYTES - (1 << 20),  # room for the rest of the message
        request_timeout=args.request_timeout,
        max_replays=args.max_replays,
        queue_timeout=args.queue_timeout,
        sample_batch_max=args.sample_batch_max,
        sample_batch_window_ms=args.sample_batch_window_ms,
        speculate=args.speculate,
        speculation=SpeculationLimits(args.speculate_tokens, args.speculate_max_requests),
        draft_model=args.draft_model,
        core=CoreLimits(
            kv_budget=kv_budget,
            kv_value_bytes=kind.kv_value_bytes,
            idle_timeout=args.request_idle_timeout,
            kv_entry_share=args.kv_entry_share,
        ),
        scheduling=SchedulerLimits(
            args.step_tokens,
            args.max_batch_rows,
            args.prefill_chunk,
            kind.prefill_buckets,
            args.max_stall,
            args.micro_batches,
        ),
    )
    advertise = args.advertise_host or (host if host not in ("0.0.0.0", "::", "") else machine.lan_host)
    api = ApiSettings(
        max_tokens_cap=args.max_tokens,
        max_body_bytes=args.max_body_kb * 1024,
        max_concurrent=args.max_concurrent_requests,
        api_key=args.api_key or None,
        cors_origins=tuple(o.strip() for o in args.cors_origins.split(",") if o.strip()),
    )
    http = None if args.no_api else HttpSettings(args.api_host, args.api_port, args.http_timeout, api)
    return Settings(node, GrpcSettings(host, args.grpc_port, advertise), http, args.drain_timeout)
