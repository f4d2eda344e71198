"""exo-node against llama.cpp RPC across hosts: network namespaces on a bridge, each host's link shaped by netem.

    uv run --group bench python -m bench.bench_multihost [--delays 0.2,1,5] [--rates 1000,100] [--hosts 2]
        [--rounds 2] [--tokens 96] [--llamacpp-bin DIR] [--cluster-key] [--no-plot]

As root (Linux). The hosts and links are bench/multihost_lan.py's: a network namespace each, a veth into a bridge
namespace, every link shaped to a one-way delay and a rate (netem, or htb and bench/delay_relay.py where the kernel
has no netem: the report says which). Every process of host i runs on core i (`taskset`), so two hosts stand for
two one-core machines; three hosts share the two cores (the report says so beside the figures). The other modes:
bench/bench_multihost_placement.py (one host slowed: the planner's split against every static split) and
bench/bench_multihost_large.py (a 7B-shaped model on hosts each capped below it).

On the same hosts, started once and idle between turns (bench/bench_rpc.py's pieces):
- exo-node: a node per host (`--quantize none --threads 1 --speed 1`, bench/bench_microbatch.py's SPLIT for two
  hosts), static peers, no cluster key (llama.cpp RPC has no encryption either), so activations and tokens go on
  the nodes' data links (node/grpc/link/) once up, the entry on host 0; with `--cluster-key`, one key for all of
  them (`exo-node keygen`), as a cluster of real machines runs: every call and link is then mutual TLS;
- llama.cpp RPC: `ggml-rpc-server -t 1` per host, `llama-server -ngl 99 --rpc` on host 0 (it reaches host 0's
  worker over loopback, the others over their links).
The client (bench/bench_serve.py's `concurrent`) runs inside host 0, so its HTTP never crosses a link. Per setting,
rounds alternate who goes first (exo, RPC, RPC, exo, ...); each turn is one stream, then 8 streams. Reported (the
median of rounds): one-stream decode tok/s, 8-stream aggregate tok/s, time to first token at one stream; per hop
(a host's egress: for two hosts, host i to the other) bytes and packets per generated token at one stream, from
`ip -s link` counters before and after (the same measure for both systems, including TCP's acknowledgements and
exo's health checks); and exo's time outside compute per hop from its status counters (node/runtime/overhead.py):
the sender's pass end -> message handed to its link and the receiver's message in its handler -> pass (the link's
own layers between them are not in it: bench_peer_stream measures those). llama.cpp exposes no such timing, so
its column is empty. Writes docs/multihost.md and docs/multihost.png (+ .json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_microbatch import SPLIT
from bench.bench_rpc import LLAMACPP_BIN, llama_server, process
from bench.local_cluster import ROOT
from bench.multihost_lan import (
    EXO_API,
    LLAMA_PORT,
    NETEM,
    RELAYED,
    RPC_PORT,
    Link,
    core,
    exo_node,
    exo_status,
    has_netem,
    listening,
    ns_get,
    rpc_addresses,
    rpc_worker,
    serve,
    shape,
    start_relays,
    tx,
    wait_exo,
    wait_for,
)
from bench.multihost_report import STREAMS, figures, outside_ms, per_token, plot, report

DOCS = ROOT / "docs"
SPLITS = {2: SPLIT, 3: ["0:12", "12:24", "24:30"]}  # the planner's, as SPLIT (the head costs ~5 layers here)
SYSTEMS = ("exo", "rpc")


def start(
    stack: contextlib.ExitStack,
    lan,
    gguf: Path,
    bin_dir: Path,
    logs: Path,
    netem: bool,
    systems=SYSTEMS,
    exo_extra: tuple[str, ...] = (),
) -> None:
    """Every host's processes, pinned to its core; returns once llama-server and every exo node answer."""
    n = len(lan.hosts)
    if not netem:
        start_relays(stack, lan, logs)
    for i in range(n if "rpc" in systems else 0):
        stack.enter_context(process(rpc_worker(lan, i, bin_dir), core(i), logs / f"rpc-{i}.log"))
    for i in range(n if "rpc" in systems else 0):  # llama-server aborts if a worker isn't there yet
        wait_for(f"ggml-rpc-server on host {i}", lambda i=i: listening(lan, i, RPC_PORT + i))
    if "rpc" in systems:
        llama = llama_server(bin_dir / "llama-server", gguf, LLAMA_PORT, rpc_addresses(lan, netem))
        stack.enter_context(process(lan.exec(0, *llama), core(0), logs / "llama.log"))
    for i in range(n):
        node = exo_node(lan, i, gguf, netem, "--shard", SPLITS[n][i], "--speed", "1", *exo_extra)
        stack.enter_context(process(node, core(i), logs / f"exo-{i}.log"))
    if "rpc" in systems:
        wait_for("llama-server", lambda: ns_get(lan, 0, f"http://127.0.0.1:{LLAMA_PORT}/health") is not None)
    wait_exo(lan)


def run_turn(lan, system: str, model_id: str, streams: int, tokens: int, round_: int, link: Link) -> dict:
    url = f"http://127.0.0.1:{EXO_API if system == 'exo' else LLAMA_PORT}"
    status = exo_status(lan) if system == "exo" else None
    before = tx(lan)
    got = serve(lan, url, model_id, streams, tokens, round_)
    after = tx(lan)
    later = exo_status(lan) if status is not None else None
    outside = outside_ms(status, later) if status is not None else None
    # each host's messages taken on its data link in the turn (none: they went on gRPC's stream)
    linked = [a.get("link_messages", 0) - b.get("link_messages", 0) for b, a in zip(status, later)] if later else None
    return {**got, "hops": per_token(before, after, got["chunks"]), "outside": outside, "link_messages": linked}


def settled(lan, timeout: float = 60) -> None:
    """Until every host's node says its start-up's work on the engine thread is over (`startup_done`: under --speed
    the draft rows' pricing after its first request), so that it lands in no timed round."""
    deadline = time.monotonic() + timeout
    while not all(s.get("startup_done") for s in exo_status(lan)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"an exo node's start-up work (startup_done in its status) did not end in {timeout:g}s")
        time.sleep(0.2)


def main() -> None:
    from shards.formats.packaged import resolve_model
    from tests.support import netns  # the multihost tests' hosts: the one exception to bench/ not importing tests/

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delays", default="0.2,1,5", help="one-way delays, ms")
    ap.add_argument("--rates", default="1000,100", help="link rates, Mbit/s")
    ap.add_argument("--hosts", type=int, default=2, choices=sorted(SPLITS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--llamacpp-bin", type=Path, default=LLAMACPP_BIN, help="llama.cpp's build/bin folder")
    ap.add_argument("--out", type=Path, default=DOCS / "multihost.md")
    ap.add_argument("--cluster-key", action="store_true", help="the exo nodes with a cluster key (mutual TLS)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    if why := netns.available():
        sys.exit(why)
    for name in ("llama-server", "ggml-rpc-server"):
        if not (args.llamacpp_bin / name).exists():
            sys.exit(f"{args.llamacpp_bin / name} is missing: build llama.cpp with -DGGML_RPC=ON (docs/benchmarks.md)")
    if not args.no_plot:
        from bench.plots import require

        require()
    links = [Link(float(d), float(r)) for d in args.delays.split(",") for r in args.rates.split(",")]
    gguf, model_id = resolve_model("smollm2")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds the stack below: processes, then namespaces
    logs = Path(tempfile.mkdtemp(prefix="bench-multihost-"))
    print(f"logs: {logs}", flush=True)
    results: dict[tuple[Link, str, int], list[dict]] = {}
    with contextlib.ExitStack() as stack:
        lan = stack.enter_context(netns.PrivateLan(args.hosts, subnet=83))
        netem = has_netem(lan)
        shape(lan, links[0], netem, logs / "delay_ms")
        keyed = ()
        if args.cluster_key:
            key = logs / "cluster.key"
            subprocess.run([sys.executable, "-m", "node.cli", "keygen", "--out", str(key)], check=True, cwd=ROOT)
            keyed = ("--cluster-key-file", str(key))
        start(stack, lan, gguf, args.llamacpp_bin, logs, netem, exo_extra=keyed)
        for system in SYSTEMS:  # warm up: graphs, the first prefill
            for streams, tokens in ((1, 4), (8, 16)):
                run_turn(lan, system, model_id, streams, tokens, -1 - streams, links[0])
        settled(lan)
        for link in links:
            shape(lan, link, netem, logs / "delay_ms")
            for r in range(args.rounds):
                for system in SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]:
                    for streams in STREAMS:
                        got = run_turn(lan, system, model_id, streams, args.tokens, r, link)
                        results.setdefault((link, system, streams), []).append(got)
                        row = {"link": link.label, "system": system, "streams": streams, "round": r}
                        print(json.dumps(row | {k: v for k, v in got.items() if k != "hops"}), flush=True)
    settings = [
        (link, *(figures({s: results[(link, sys_, s)] for s in STREAMS}) for sys_ in SYSTEMS)) for link in links
    ]
    command = "uv run --group bench python -m bench.bench_multihost " + " ".join(sys.argv[1:])
    links_are = NETEM if netem else RELAYED
    args.out.write_text(report(settings, args.hosts, command.strip(), os.getloadavg()[0], links_are, args.cluster_key))
    print(f"wrote {args.out}")
    if not args.no_plot:
        print(f"wrote {plot(settings, args.hosts, args.out.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
