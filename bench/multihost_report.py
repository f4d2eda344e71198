"""The links benchmark's figures (bench/bench_multihost.py): the counters' arithmetic, the medians of rounds, and
the report: one markdown table per link setting, exo-node beside llama.cpp RPC, and a plot."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.multihost_lan import NETEM, Link

STREAMS = (1, 8)
GOALS = {1: 1.0, 8: 1.5}  # exo / llama.cpp RPC: one-stream decode, 8-stream aggregate
HOP_KEYS = (
    "hop_out_us_total",
    "hop_out",
    "hop_write_us_total",
    "hop_writes",
    "hop_accept_us_total",
    "hop_accepts",
    "hop_in_us_total",
    "hop_in",
)


def per_token(before: list[tuple[int, int]], after: list[tuple[int, int]], tokens: int) -> list[tuple[float, float]]:
    """Each hop's (bytes, packets) per generated token between two readings of every host's egress."""
    if tokens <= 0:
        raise ValueError("no tokens were generated: nothing to divide the traffic by")
    return [((a[0] - b[0]) / tokens, (a[1] - b[1]) / tokens) for b, a in zip(before, after)]


def outside_ms(before: list[dict], after: list[dict]) -> list[float]:
    """Per hop i -> i+1 (mean ms), the token's path through the nodes' own work: node i's pass end -> its message
    handed to its link's write (the hand-off, the core, encoding), then node i+1's message in its handler -> the
    pass that runs it (decoding, the core, the hand-off); from the nodes' status counters (`before`/`after`, one
    dict per host). The link's own layers between the write and the handler are not in it (bench_peer_stream
    measures them). Not the call's answer: nothing on the token's path waits for it."""
    d = [{k: a.get(k, 0) - b.get(k, 0) for k in HOP_KEYS} for b, a in zip(before, after)]
    mean = lambda c, total, n: c[total] / max(1, c[n]) / 1000  # noqa: E731
    return [
        mean(c, "hop_out_us_total", "hop_out")
        + mean(c, "hop_write_us_total", "hop_writes")
        + mean(d[(i + 1) % len(d)], "hop_accept_us_total", "hop_accepts")
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
        (f"node work per token per hop, ms, {hops}", nums(exo.outside_ms, ".2f"), nums(rpc.outside_ms, ".2f"), ""),
    ]  # fmt: skip
    lines = [
        f"### {link.label}, {hosts} hosts{shared}",
        "",
        "| | exo-node | llama.cpp RPC | exo / RPC |",
        "|---|---|---|---|",
    ]
    return "\n".join(lines + [f"| {' | '.join(r)} |" for r in rows]) + "\n"


def report(
    settings: list[tuple[Link, Figures, Figures]],
    hosts: int,
    command: str,
    load: float,
    links: str = NETEM,
    keyed: bool = False,
) -> str:
    head = [
        "# exo-node and llama.cpp RPC across hosts",
        "",
        f"Written by `{command}` (bench/bench_multihost.py: how the hosts, links and systems are set up).",
        f"{hosts} hosts, each a network namespace; "
        + ("each pinned to a core of its own." if hosts <= 2 else f"the {hosts} hosts share the machine's 2 cores.")
        + f" {links[0].upper()}{links[1:]}. Load average at the end: {load:.1f}."
        " Per hop: at one stream, from the hosts' veth counters; outside compute: exo's status counters, the"
        " sender's pass end to its message handed to its link (the data link, node/grpc/link/) and the receiver's"
        " handler to its pass (the link's own layers between them are not counted; llama.cpp RPC has no counters)."
        + (
            " The exo nodes share a cluster key, as real machines do: every call and link between them is mutual TLS"
            " (llama.cpp RPC's are plaintext and unauthenticated)."
            if keyed
            else ""
        ),
        "",
        "The other multi-host modes: [placement by measured speed](multihost-placement.md) (one host slowed: the"
        " planner's split against every static split) and [a model no node can hold](multihost-large.md).",
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
        top = max(getattr(s[1 + k], what) for s in settings for k in (0, 1))
        ax.set_ylim(0, top * 1.25)  # room above the bars for the legend, which hid the short ones at the bottom
        ax.legend(loc="upper right", ncol=2, framealpha=0.9)
    data = [{"link": link.label, "exo": asdict(exo), "rpc": asdict(rpc)} for link, exo, rpc in settings]
    return _save(fig, path, data)
