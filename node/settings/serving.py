"""The flags of how a node serves requests: their limits and the KV cache, what one forward pass carries, and
speculative decoding. They become one `NodeSettings` (node/runtime/settings.py), the core's limits inside it."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from node.core.admission import CoreLimits
from node.core.scheduler import SchedulerLimits
from node.core.speculation import SpeculationLimits
from node.grpc.client import DEFAULT_MAX_MESSAGE_BYTES
from node.runtime.keep_awake import supported as keep_awake_unsupported
from node.runtime.settings import PREFIX_CACHE_CHOICES, SPECULATE_CHOICES, NodeSettings
from node.settings.machine import Machine
from node.settings.model import EngineSettings, parse_shard
from shards.engines.registry import engine_class

KV_SHARE_OF_MEMORY = 0.4  # the KV cache's default budget: this share of the available memory


def add_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("requests and the KV cache")
    g.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="seconds without a token (or, during a long prompt, a chunk of it reaching the last node) before failing",
    )
    g.add_argument(
        "--prefix-cache",
        choices=PREFIX_CACHE_CHOICES,
        default="shared",
        help="reuse of finished requests' KV caches by later requests that start with the same tokens: shared by "
        "every client (default), per-key (only by requests with the same API key: another client can't learn "
        "from a faster answer that a prompt was cached), or off",
    )
    g.add_argument(
        "--max-replays",
        type=int,
        default=2,
        help="replay a request on a new plan at most this often when a node of its plan is lost",
    )
    g.add_argument(
        "--request-idle-timeout",
        type=float,
        default=60.0,
        help="forget a request whose next input has not come for this many seconds (default 60)",
    )
    g.add_argument(
        "--queue-timeout",
        type=float,
        default=30.0,
        help="how long a request waits for room in the cluster before a 503 (default 30 s)",
    )
    g.add_argument(
        "--keep-awake",
        action="store_true",
        help="while serving requests, spin this node's idle cores at the lowest priority (SCHED_IDLE, Linux) so "
        "a message that arrives finds them awake: faster per token where waking a core is slow (VMs), at the cost "
        "of those cores' power",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, wait at most this long for requests in flight before exiting (default 30)",
    )
    g.add_argument(
        "--kv-memory-gb",
        type=float,
        help="KV cache memory this node may reserve for requests (default: 40%% of the available memory); "
        "a request that doesn't fit waits for room, then gets a 503",
    )
    g.add_argument(
        "--kv-entry-share",
        type=float,
        default=0.5,
        help="of that memory, the most the requests of one other entry node may reserve together "
        "(default 0.5): a peer can't take it all; this node's own requests are not limited",
    )

    g = ap.add_argument_group("scheduling", "what one forward pass carries, and sampling")
    g.add_argument(
        "--step-tokens",
        type=int,
        default=SchedulerLimits.step_tokens,
        help="positions one forward pass may carry (decode rows + prompt chunks, padded)",
    )
    g.add_argument(
        "--max-batch-rows",
        type=int,
        default=SchedulerLimits.max_batch_rows,
        help="decoding requests one forward pass carries; more wait their turn",
    )
    g.add_argument(
        "--prefill-chunk",
        type=int,
        default=SchedulerLimits.prefill_chunk,
        help="longest piece of a prompt prefilled in one forward pass (long prompts take several)",
    )
    g.add_argument(
        "--max-stall",
        type=float,
        default=SchedulerLimits.max_stall,
        help="while requests are decoding, a step adds only as much prompt prefill as keeps it within this "
        "many decode steps' time (measured as it runs), so a long prompt never freezes the streams",
    )
    g.add_argument(
        "--micro-batches",
        type=int,
        default=SchedulerLimits.micro_batches,
        help="on a ring of several nodes, split the decoding requests in this many batches that follow each other "
        "round the ring, so every node computes at once (default 0: one per node of the ring; 1: one batch)",
    )
    g.add_argument(
        "--sample-batch-max",
        type=int,
        default=8,
        help="last shard: sample up to this many requests' rows in one call (1 disables batching)",
    )
    g.add_argument(
        "--sample-batch-window-ms",
        type=float,
        default=5.0,
        help="last shard: close a sampling batch this long after its first row (0 disables batching)",
    )

    g = ap.add_argument_group("speculative decoding", "docs/operations.md, Speculative decoding")
    g.add_argument(
        "--speculate",
        choices=SPECULATE_CHOICES,
        default="lookup",
        help="speculative decoding as a request's first node: propose tokens by prompt lookup (default), with a "
        "draft model (--draft-model), or not at all; the last node verifies them, the output is the same",
    )
    g.add_argument(
        "--speculate-tokens",
        type=int,
        default=SpeculationLimits.max_drafts,
        help=f"the most tokens proposed per step of a request (default {SpeculationLimits.max_drafts}; fewer "
        "while they are rejected)",
    )
    g.add_argument(
        "--speculate-max-requests",
        type=int,
        default=SpeculationLimits.max_requests,
        help=f"propose only while this node holds at most this many requests (default "
        f"{SpeculationLimits.max_requests}: beside many decoding requests, draft rows cost the batch compute)",
    )
    g.add_argument(
        "--draft-model",
        type=Path,
        help="with --speculate draft: a small model (GGUF file or folder) with the same tokenizer",
    )


def node_from_args(args: argparse.Namespace, *, node_id: str, engine: EngineSettings, machine: Machine) -> NodeSettings:
    """The node's settings; the largest tensor a peer may send is the default message bound's until the model is
    known (node/cli.py narrows it to the model's)."""
    kind = engine_class(engine.name)
    if args.kv_memory_gb is not None and not args.kv_memory_gb > 0:
        raise ValueError(
            f"--kv-memory-gb must be positive (leave it out for 40% of the memory), got {args.kv_memory_gb}"
        )
    kv_budget = (
        int(args.kv_memory_gb * 2**30)
        if args.kv_memory_gb is not None
        else int(KV_SHARE_OF_MEMORY * machine.memory_for_layers)
    )
    if not 0 < args.kv_entry_share <= 1:
        raise ValueError(f"--kv-entry-share must be in (0, 1], got {args.kv_entry_share}")
    if args.keep_awake and (why := keep_awake_unsupported()):
        raise ValueError(why)
    if args.micro_batches < 0:
        raise ValueError(f"--micro-batches must be 0 (one per node of the ring) or more, got {args.micro_batches}")
    return NodeSettings(
        node_id=node_id,
        memory_bytes=int(args.memory_gb * 2**30) if args.memory_gb is not None else machine.memory_for_layers,
        host_memory_bytes=machine.available_memory,
        device=machine.gpu.label if machine.gpu is not None else "",
        speed=args.speed,
        engine=engine.name,
        pinned=parse_shard(args.shard),
        max_tensor_bytes=DEFAULT_MAX_MESSAGE_BYTES - (1 << 20),  # room for the rest of the message
        request_timeout=args.request_timeout,
        max_replays=args.max_replays,
        queue_timeout=args.queue_timeout,
        prefix_cache=args.prefix_cache,
        keep_awake=((engine.threads or os.cpu_count() or 1) + 1) if args.keep_awake else 0,
        sample_batch_max=args.sample_batch_max,
        sample_batch_window_ms=args.sample_batch_window_ms,
        speculate=args.speculate,
        speculation=SpeculationLimits(args.speculate_tokens, args.speculate_max_requests),
        draft_model=args.draft_model,
        core=CoreLimits(
            kv_budget=kv_budget,
            kv_value_bytes=kind.kv_value_bytes,
            kv_values_twice=kind.kv_values_twice,
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
