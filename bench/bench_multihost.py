"""exo-node against llama.cpp RPC across hosts: network namespaces on a bridge, each host's link shaped by netem.

    uv run --group bench python -m bench.bench_multihost [--delays 0.2,1,5] [--rates 1000,100] [--hosts 2]
        [--rounds 2] [--tokens 96] [--llamacpp-bin DIR] [--no-plot]

As root (Linux). The hosts are tests/support/netns.py's: one namespace each, a veth into a bridge namespace. Every
process of host i runs on core i (`taskset`), so two hosts stand for two one-core machines; three hosts share the
two cores (the report says so beside the figures). A link setting is a one-way delay and a rate: each host's
egress (eth0) gets `netem delay D rate R` and its switch port's egress `netem rate R`, so host to host is D one way
and every host's link carries at most R in each direction. On a kernel without sch_netem (probed at start) the
rate is shaped by htb and the delay added by bench/delay_relay.py, a relay on every host through which its processes
reach the others (the report says which was used).

On the same hosts, started once and idle between turns (bench/bench_rpc.py's pieces):
- exo-node: a node per host (`--quantize none --threads 1 --speed 1`, bench/bench_microbatch.py's SPLIT for two
  hosts), static peers, plain gRPC (no cluster key: llama.cpp RPC has no encryption either), the entry on host 0;
- llama.cpp RPC: `ggml-rpc-server -t 1` per host, `llama-server -ngl 99 --rpc` on host 0 (it reaches host 0's
  worker over loopback, the others over their links).
The client (bench/bench_serve.py's `concurrent`) runs inside host 0, so its HTTP never crosses a link. Per setting,
rounds alternate who goes first (exo, RPC, RPC, exo, ...); each turn is one stream, then 8 streams. Reported (the
median of rounds): one-stream decode tok/s, 8-stream aggregate tok/s, time to first token at one stream; per hop
(a host's egress: for two hosts, host i to the other) bytes and packets per generated token at one stream, from
`ip -s link` counters before and after (the same measure for both systems, including TCP's acknowledgements and
exo's health checks); and exo's time outside compute per hop from its status counters (node/runtime/overhead.py):
the sender's hand-off, the transport call less the link's round trip, and the receiver's hand-off. llama.cpp
exposes no such timing, so its column is empty. Writes docs/multihost.md and docs/multihost.png (+ .json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.bench_microbatch import SPLIT
from bench.bench_rpc import LLAMACPP_BIN, llama_server, process
from bench.local_cluster import ROOT

DOCS = ROOT / "docs"
SPLITS = {2: SPLIT, 3: ["0:13", "13:25", "25:30"]}  # SmolLM2: ~13 layers' work each (the head costs ~8 layers)
EXO_GRPC, RPC_PORT = 50051, 50100  # host i's exo node and ggml-rpc-server listen on these + i
EXO_API, LLAMA_PORT = 52415, 8080  # on each host's own loopback
STREAMS = (1, 8)
GOALS = {1: 1.0, 8: 1.5}  # exo / llama.cpp RPC: one-stream decode, 8-stream aggregate
SYSTEMS = ("exo", "rpc")
HOP_KEYS = ("hop_out_us_total", "hop_out", "hop_send_us_total", "hop_sends", "hop_in_us_total", "hop_in")
CLIENT = (
    "import asyncio, json, sys; from bench.bench_serve import concurrent; "
    "print(json.dumps(asyncio.run(concurrent(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])))))"
)
GET = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
CONNECT = "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5).close()"


@dataclass(frozen=True)
class Link:
    """A host's link: `delay_ms` one way to any other host, `rate_mbit` each way."""

    delay_ms: float
    rate_mbit: float

    def __post_init__(self):
        if self.delay_ms < 0 or self.rate_mbit <= 0:
            raise ValueError(f"a link needs a delay >= 0 ms and a rate > 0 Mbit/s, got {self}")

    @property
    def label(self) -> str:
        rate = f"{self.rate_mbit / 1000:g} Gbit/s" if self.rate_mbit >= 1000 else f"{self.rate_mbit:g} Mbit/s"
        return f"{self.delay_ms:g} ms, {rate}"


def netem_commands(host: str, switch: str, port: str, link: Link, netem: bool = True) -> list[list[str]]:
    """`tc` argument vectors shaping one host: the delay on its egress only (one way between two hosts is then one
    delay, not two), the rate on both its egress and its switch port's (what the bridge sends it). `netem=False`
    (a kernel without sch_netem): the rate by htb, the delay left to bench/delay_relay.py."""
    rate = f"{link.rate_mbit:g}mbit"
    if not netem:  # htb can't be replaced by htb: remove the last setting's (a first `del` finds none: ignored)
        return [
            cmd
            for ns, dev in ((host, "eth0"), (switch, port))
            for cmd in (
                ["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"],
                ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"],
                ["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate],
            )
        ]
    return [
        ["tc", "-n", host, "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", f"{link.delay_ms:g}ms"]
        + ["rate", rate],
        ["tc", "-n", switch, "qdisc", "replace", "dev", port, "root", "netem", "rate", rate],
    ]


def relays(ips: list[str], i: int) -> list[str]:
    """bench/delay_relay.py's pairs on host i (no netem): each other host's exo node, and from the entry host each
    other host's RPC worker, at its port on i's loopback, which is where i's processes reach it."""
    pairs = [(EXO_GRPC + j, ip) for j, ip in enumerate(ips) if j != i]
    pairs += [(RPC_PORT + j, ip) for j, ip in enumerate(ips) if j != i and i == 0]
    return [f"127.0.0.1:{port}={ip}:{port}" for port, ip in pairs]


def tx_counters(ip_json: str) -> tuple[int, int]:
    """(bytes, packets) sent by the link of `ip -j -s link show DEV`."""
    tx = json.loads(ip_json)[0]["stats64"]["tx"]
    return tx["bytes"], tx["packets"]


def per_token(before: list[tuple[int, int]], after: list[tuple[int, int]], tokens: int) -> list[tuple[float, float]]:
    """Each hop's (bytes, packets) per generated token between two readings of every host's egress."""
    if tokens <= 0:
        raise ValueError("no tokens were generated: nothing to divide the traffic by")
    return [((a[0] - b[0]) / tokens, (a[1] - b[1]) / tokens) for b, a in zip(before, after)]


def outside_ms(before: list[dict], after: list[dict], delay_ms: float) -> list[float]:
    """Per hop i -> i+1 (mean ms): node i's pass end -> transport call, the call less the link's round trip, and
    node i+1's arrival -> its pass; from the nodes' status counters (`before`/`after`, one dict per host)."""
    d = [{k: a.get(k, 0) - b.get(k, 0) for k in HOP_KEYS} for b, a in zip(before, after)]
    mean = lambda c, total, n: c[total] / max(1, c[n]) / 1000  # noqa: E731
    return [
        mean(c, "hop_out_us_total", "hop_out")
        + mean(c, "hop_send_us_total", "hop_sends")
        - 2 * delay_ms
        + mean(d[(i + 1) % len(d)], "hop_in_us_total", "hop_in")
        for i, c in enumerate(d)
    ]


@dataclass(frozen=True)
class Figures:
    """One system's medians at one link setting."""

    one_stream: float  # decode tok/s
    aggregate: float  # 8 streams, tok/s
    ttft_ms: float  # one stream
    bytes_per_token: tuple[float, ...]  # per hop, at one stream
    packets_per_token: tuple[float, ...]
    outside_ms: tuple[float, ...] | None  # per hop; None where the system exposes no timing

    def __post_init__(self):
        if len(self.bytes_per_token) != len(self.packets_per_token):
            raise ValueError("bytes and packets need one figure per hop each")


def figures(rounds: dict[int, list[dict]]) -> Figures:
    """Medians over rounds of the turns `rounds[streams]` (dicts of run_turn)."""
    med = statistics.median
    one, eight = rounds[1], rounds[8]
    hops = range(len(one[0]["hops"]))
    outside = [r["outside"] for r in one if r["outside"] is not None]
    return Figures(
        one_stream=med(r["per_stream"] for r in one),
        aggregate=med(r["aggregate"] for r in eight),
        ttft_ms=med(r["ttft"] for r in one) * 1000,
        bytes_per_token=tuple(med(r["hops"][h][0] for r in one) for h in hops),
        packets_per_token=tuple(med(r["hops"][h][1] for r in one) for h in hops),
        outside_ms=tuple(med(o[h] for o in outside) for h in hops) if outside else None,
    )


def table(link: Link, hosts: int, exo: Figures, rpc: Figures) -> str:
    """One setting's markdown table: both systems, exo's ratio to llama.cpp RPC, and the goal it is held to."""
    hop = lambda i: f"h{i}→h{(i + 1) % hosts}" if hosts == 2 else f"h{i} out"  # noqa: E731
    nums = lambda xs, fmt: " / ".join(format(x, fmt) for x in xs) if xs is not None else "—"  # noqa: E731
    verdict = lambda r, goal: f"{r:.2f}x (goal ≥ {goal:.1f}x: {'met' if r >= goal else 'missed'})"  # noqa: E731
    hops = " / ".join(hop(i) for i in range(hosts))
    shared = " (3 hosts share the 2 cores)" if hosts > 2 else ""
    rows = [
        ("one stream, decode tok/s", f"{exo.one_stream:.1f}", f"{rpc.one_stream:.1f}",
         verdict(exo.one_stream / rpc.one_stream, GOALS[1])),
        ("8 streams, aggregate tok/s", f"{exo.aggregate:.1f}", f"{rpc.aggregate:.1f}",
         verdict(exo.aggregate / rpc.aggregate, GOALS[8])),
        ("time to first token, ms", f"{exo.ttft_ms:.0f}", f"{rpc.ttft_ms:.0f}", f"{exo.ttft_ms / rpc.ttft_ms:.2f}x"),
        (f"bytes per token, {hops}", nums(exo.bytes_per_token, ".0f"), nums(rpc.bytes_per_token, ".0f"), ""),
        (f"packets per token, {hops}", nums(exo.packets_per_token, ".1f"), nums(rpc.packets_per_token, ".1f"), ""),
        (f"outside compute per token, ms, {hops}", nums(exo.outside_ms, ".2f"), nums(rpc.outside_ms, ".2f"), ""),
    ]  # fmt: skip
    lines = [
        f"### {link.label}, {hosts} hosts{shared}",
        "",
        "| | exo-node | llama.cpp RPC | exo / RPC |",
        "|---|---|---|---|",
    ]
    return "\n".join(lines + [f"| {' | '.join(r)} |" for r in rows]) + "\n"


NETEM = "links shaped by netem (delay and rate)"
RELAYED = (
    "this kernel has no netem: rates shaped by htb, delays added by bench/delay_relay.py on every connection between "
    "hosts (its own TCP legs are undelayed, and its threads share the hosts' cores)"
)


def report(
    settings: list[tuple[Link, Figures, Figures]], hosts: int, command: str, load: float, links: str = NETEM
) -> str:
    head = [
        "# exo-node and llama.cpp RPC across hosts",
        "",
        f"Written by `{command}` (bench/bench_multihost.py: how the hosts, links and systems are set up).",
        f"{hosts} hosts, each a network namespace; "
        + ("each pinned to a core of its own." if hosts <= 2 else f"the {hosts} hosts share the machine's 2 cores.")
        + f" {links[0].upper()}{links[1:]}. Load average at the end: {load:.1f}."
        " Per hop: at one stream, from the hosts' veth counters; outside compute: exo's status counters"
        " (llama.cpp RPC has none).",
        "",
        "",
    ]
    return "\n".join(head) + "\n".join(table(link, hosts, exo, rpc) for link, exo, rpc in settings)


def plot(settings: list[tuple[Link, Figures, Figures]], hosts: int, path: Path) -> Path:
    from bench.plots import COLORS, _pyplot, _save

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    labels = [link.label for link, _, _ in settings]
    xs = range(len(settings))
    for ax, what, title in (
        (axes[0], "one_stream", "one stream, decode"),
        (axes[1], "aggregate", "8 streams, aggregate"),
    ):
        for k, (name, color) in enumerate(zip(("exo-node", "llama.cpp RPC"), COLORS)):
            ax.bar([x + 0.4 * k for x in xs], [getattr(s[1 + k], what) for s in settings], 0.4, color=color, label=name)
        ax.set_xticks([x + 0.2 for x in xs], labels, rotation=30, ha="right")
        ax.set_ylabel("tok/s")
        ax.set_title(f"{title}, {hosts} hosts" + (" (sharing 2 cores)" if hosts > 2 else ""))
        ax.legend(loc="lower right", framealpha=0.9)
    data = [{"link": link.label, "exo": asdict(exo), "rpc": asdict(rpc)} for link, exo, rpc in settings]
    return _save(fig, path, data)


# -- the hosts and the systems on them ----------------------------------------------------------------------------
def ns_run(lan, i: int, *cmd: str, timeout: float = 1800) -> str:
    return subprocess.run(
        lan.exec(i, *cmd), cwd=ROOT, capture_output=True, text=True, check=True, timeout=timeout
    ).stdout


def ns_get(lan, i: int, url: str) -> dict | None:
    """GET `url` from inside host i (its loopback is its own); None while nothing answers there."""
    try:
        return json.loads(ns_run(lan, i, sys.executable, "-c", GET, url, timeout=30))
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return None


def listening(lan, i: int, port: int) -> bool:
    """Whether something accepts TCP on host i's loopback port."""
    try:
        ns_run(lan, i, sys.executable, "-c", CONNECT, str(port), timeout=30)
        return True
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return False


def wait_for(what: str, ready, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout:g} s: see the logs in the folder printed above")
        time.sleep(1)


def has_netem(lan) -> bool:
    probe = ["tc", "-n", lan.hosts[0], "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", "0ms"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def shape(lan, link: Link, netem: bool, delay_file: Path) -> None:
    for i, host in enumerate(lan.hosts):
        for cmd in netem_commands(host, lan.switch, f"p{i}", link, netem):
            subprocess.run(cmd, check=cmd[3:5] != ["qdisc", "del"], capture_output=True)
    delay_file.write_text("0" if netem else f"{link.delay_ms:g}")
    time.sleep(0.5)  # the relays re-read it every 0.2 s


def tx(lan) -> list[tuple[int, int]]:
    run = lambda h: subprocess.run(["ip", "-n", h, "-j", "-s", "link", "show", "eth0"], capture_output=True, text=True)  # noqa: E731
    return [tx_counters(run(h).stdout) for h in lan.hosts]


def exo_status(lan) -> list[dict]:
    """Each host's node's own status counters (the first node of its topology is itself)."""
    got = [ns_get(lan, i, f"http://127.0.0.1:{EXO_API}/v1/topology") for i in range(len(lan.hosts))]
    if None in got:
        raise RuntimeError(f"the exo node on host {got.index(None)} stopped answering: see its log")
    return [t["nodes"][0]["status"] for t in got]


def start(
    stack: contextlib.ExitStack, lan, gguf: Path, bin_dir: Path, logs: Path, netem: bool, systems=SYSTEMS
) -> None:
    """Every host's processes, pinned to its core; returns once llama-server and every exo node answer."""
    n, cores = len(lan.hosts), sorted(os.sched_getaffinity(0))
    core = lambda i: cores[i % len(cores)]  # noqa: E731
    reach = lambda i, j: "127.0.0.1" if i == j or not netem else lan.ips[j]  # noqa: E731 (host j, from host i)
    for i in range(n if not netem else 0):
        relay = [sys.executable, "-m", "bench.delay_relay", str(logs / "delay_ms"), *relays(lan.ips, i)]
        stack.enter_context(process(lan.exec(i, *relay), core(i), logs / f"relay-{i}.log"))
    for i in range(n if "rpc" in systems else 0):
        rpc = [str(bin_dir / "ggml-rpc-server"), "-H", "0.0.0.0", "-p", str(RPC_PORT + i), "-t", "1"]
        stack.enter_context(process(lan.exec(i, *rpc), core(i), logs / f"rpc-{i}.log"))
    for i in range(n if "rpc" in systems else 0):  # llama-server aborts if a worker isn't there yet
        wait_for(f"ggml-rpc-server on host {i}", lambda i=i: listening(lan, i, RPC_PORT + i))
    if "rpc" in systems:
        llama = llama_server(
            bin_dir / "llama-server", gguf, LLAMA_PORT, [f"{reach(0, i)}:{RPC_PORT + i}" for i in range(n)]
        )
        stack.enter_context(process(lan.exec(0, *llama), core(0), logs / "llama.log"))
    for i in range(n):
        peers = ",".join(f"{reach(i, j)}:{EXO_GRPC + j}" for j in range(n) if j != i)
        node = [sys.executable, "-m", "node.cli", "--model", str(gguf), "--node-id", f"host{i}", "--host", lan.ips[i]]
        node += ["--advertise-host", "127.0.0.1"] if not netem else []  # peers reach it through their own relays
        node += ["--grpc-port", str(EXO_GRPC + i), "--discovery", "none", "--peers", peers, "--shard", SPLITS[n][i]]
        node += ["--api-port", str(EXO_API), "--quantize", "none", "--threads", "1", "--speed", "1"]
        stack.enter_context(process(lan.exec(i, *node), core(i), logs / f"exo-{i}.log"))
    if "rpc" in systems:
        wait_for("llama-server", lambda: ns_get(lan, 0, f"http://127.0.0.1:{LLAMA_PORT}/health") is not None)
    for i in range(n):
        topo = lambda i=i: ns_get(lan, i, f"http://127.0.0.1:{EXO_API}/v1/topology")  # noqa: E731
        wait_for(f"exo node on host {i}", lambda t=topo: (got := t()) is not None and len(got["nodes"]) == n)


def run_turn(lan, system: str, model_id: str, streams: int, tokens: int, round_: int, link: Link) -> dict:
    url = f"http://127.0.0.1:{EXO_API if system == 'exo' else LLAMA_PORT}"
    status = exo_status(lan) if system == "exo" else None
    before = tx(lan)
    got = json.loads(
        ns_run(lan, 0, sys.executable, "-c", CLIENT, url, model_id, str(streams), str(tokens), str(round_))
    )
    after = tx(lan)
    outside = outside_ms(status, exo_status(lan), link.delay_ms) if status is not None else None
    return {**got, "hops": per_token(before, after, got["chunks"]), "outside": outside}


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
        start(stack, lan, gguf, args.llamacpp_bin, logs, netem)
        for system in SYSTEMS:  # warm up: graphs, the first prefill
            for streams, tokens in ((1, 4), (8, 16)):
                run_turn(lan, system, model_id, streams, tokens, -1 - streams, links[0])
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
    args.out.write_text(report(settings, args.hosts, command.strip(), os.getloadavg()[0], NETEM if netem else RELAYED))
    print(f"wrote {args.out}")
    if not args.no_plot:
        print(f"wrote {plot(settings, args.hosts, args.out.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
