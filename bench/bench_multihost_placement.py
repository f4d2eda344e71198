"""Placement by measured speed across hosts: with one host held to half a core, the planner's split against every
static split, by the aggregate at 8 streams.

    uv run --group bench python -m bench.bench_multihost_placement [--hosts 2] [--slow 1] [--quota 0.5]
        [--delay 0.2] [--rate 1000] [--rounds 2] [--tokens 64] [--step 1] [--splits 0:19/19:30,...] [--no-plot]

As root (Linux), on bench/multihost_lan.py's hosts (host i on core i; 3 hosts share 2 cores), one link setting.
Host `--slow` runs its node (not its link's relay) inside a cgroup CPU quota (tests/support/cgroups.py) of
`--quota` of a core, joined before its first instruction. The same packaged SmolLM2 file throughout, exo-node only
(`--threads 1 --quantize none`, entry on host 0); each configuration is a fresh start of every node:
- the planner's: no `--shard`, no `--speed`: the nodes start one after another, each calibrating itself
  (node/runtime/calibration.py) while the others idle, and the entry's plan (GET /v1/topology) is what is measured;
- every static split: `--shard` on each node (`--speed 1`: nothing to calibrate), boundaries every `--step` layers
  (all of them by default: 29 for 2 hosts), or the `--splits` given.
Per configuration: a warm-up, then `--rounds` turns of 8 streams of `--tokens` (bench/bench_serve.py's client, on
host 0); the median aggregate is reported. Writes docs/multihost-placement.md (+ .png, .json): every split's
aggregate, the planner's, and planner / best static (the goal: >= 0.9x).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.bench_rpc import process
from bench.local_cluster import ROOT
from bench.multihost_lan import (
    EXO_API,
    NETEM,
    RELAYED,
    Link,
    core,
    exo_node,
    has_netem,
    joined,
    serve,
    shape,
    start_relays,
    topology,
    wait_exo,
    wait_for,
)

GOAL = 0.9  # the planner's aggregate / the best static split's
STREAMS = 8
Ranges = tuple[tuple[int, int] | None, ...]  # host i's layers [start, end), None: left out of the ring


@dataclass(frozen=True)
class Split:
    """Each host's layers, in host order; together they tile [0, n_layers) in order."""

    ranges: Ranges

    def __post_init__(self):
        held = [r for r in self.ranges if r is not None]
        if not held or held[0][0] != 0 or any(a[1] != b[0] for a, b in zip(held, held[1:])):
            raise ValueError(f"a split's ranges must tile the layers from 0 in host order, got {self.ranges}")
        if any(s >= e for s, e in held):
            raise ValueError(f"every held range needs start < end, got {self.ranges}")

    @property
    def label(self) -> str:
        return " / ".join("—" if r is None else f"{r[0]}:{r[1]}" for r in self.ranges)

    @classmethod
    def parse(cls, text: str) -> Split:
        """`0:19/19:30`: one `--shard` value per host."""
        try:
            ranges = [tuple(int(x) for x in part.split(":")) for part in text.split("/")]
            if any(len(r) != 2 for r in ranges):
                raise ValueError(f"{text!r} has a range that is not START:END")
            return cls(tuple(ranges))  # type: ignore[arg-type]
        except ValueError as e:
            raise ValueError(f"a split is one START:END per host joined by '/', like 0:19/19:30: {e}") from None


def static_splits(n_layers: int, hosts: int, step: int = 1) -> list[Split]:
    """Every split giving each host at least one layer, its boundaries on multiples of `step`, in order."""
    if step < 1 or hosts < 1:
        raise ValueError(f"splits need hosts >= 1 and a step >= 1, got {hosts} hosts, step {step}")
    cuts = range(step, n_layers, step)
    return [Split(tuple(zip((0, *b), (*b, n_layers)))) for b in itertools.combinations(cuts, hosts - 1)]


def planned_split(topo: dict, hosts: int) -> Split:
    """The split of the entry's plan (GET /v1/topology), host i being node `host{i}`."""
    steps = {s["node_id"]: (s["start"], s["end"]) for s in topo["plan"]}
    return Split(tuple(steps.get(f"host{i}") for i in range(hosts)))


@dataclass(frozen=True)
class Outcome:
    """One configuration's turns: each turn's aggregate tok/s at 8 streams."""

    split: Split
    aggregates: tuple[float, ...]
    speeds: tuple[float, ...] | None = None  # Gparam/s each host reported (the planner's configuration)

    def __post_init__(self):
        if not self.aggregates:
            raise ValueError(f"split {self.split.label} has no measured turn")

    @property
    def median(self) -> float:
        return statistics.median(self.aggregates)


def report(planner: Outcome, statics: list[Outcome], head: str) -> str:
    """The markdown: the planner's split and figure, every static split's, and planner / best static."""
    best = max(statics, key=lambda o: o.median)
    ratio = planner.median / best.median
    verdict = f"{ratio:.2f}x (goal ≥ {GOAL:.1f}x: {'met' if ratio >= GOAL else 'missed'})"
    speeds = " / ".join(f"{s:.2f}" for s in planner.speeds) if planner.speeds else "—"
    rows = [f"| planner: {planner.split.label} | {planner.median:.1f} | measured speeds {speeds} Gparam/s |"]
    for o in statics:
        notes = [n for n, yes in (("best static", o is best), ("the planner's split", o.split == planner.split)) if yes]
        rows.append(f"| {o.split.label} | {o.median:.1f} | {', '.join(notes)} |")
    lines = [
        head,
        "",
        f"**Planner / best static split ({best.split.label}): {verdict}.**",
        "",
        f"| split (host 0 / host 1 / ...) | {STREAMS} streams, aggregate tok/s (median) | |",
        "|---|---|---|",
    ]
    return "\n".join(lines + rows) + "\n"


def plot(planner: Outcome, statics: list[Outcome], slow: int, quota: float, path: Path) -> Path:
    from bench.plots import COLORS, _pyplot, _save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(statics) + 2), 3.4))
    xs = range(len(statics))
    colors = [COLORS[1] if o.split == planner.split else COLORS[0] for o in statics]
    ax.bar(xs, [o.median for o in statics], 0.8, color=colors, label="static split (--shard)")
    ax.axhline(planner.median, color=COLORS[2], label=f"planner: {planner.split.label}")
    ax.set_xticks(list(xs), [o.split.label for o in statics], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(f"tok/s, {STREAMS} streams")
    ax.set_title(f"host {slow} held to {quota:g} of a core: every static split and the planner's")
    ax.legend(loc="lower right", framealpha=0.9)
    data = {"planner": asdict(planner), "static": [asdict(o) for o in statics]}
    return _save(fig, path, data)


# -- running the configurations -----------------------------------------------------------------------------------
def n_layers(gguf_path: Path) -> int:
    import gguf

    fields = gguf.GGUFReader(gguf_path).fields
    return int(fields[f"{fields['general.architecture'].contents()}.block_count"].contents())


def speed(node: dict) -> float:
    """A node's reported speed (Gparam/s; 0 until measured) from its entry in a topology."""
    return node["capabilities"]["speed"]


def measure(lan, model_id: str, rounds: int, tokens: int) -> tuple[float, ...]:
    url = f"http://127.0.0.1:{EXO_API}"
    serve(lan, url, model_id, 1, 4, -1)  # warm up: graphs, the first prefill
    serve(lan, url, model_id, STREAMS, 16, -2)
    return tuple(serve(lan, url, model_id, STREAMS, tokens, r)["aggregate"] for r in range(rounds))


def run(lan, gguf_path: Path, model_id: str, split: Split | None, groups, netem: bool, logs: Path, args) -> Outcome:
    """One configuration from a fresh start: `split` pinned with --shard, or None: the planner's, measured."""
    n = len(lan.hosts)
    tag = "planner" if split is None else split.label.replace(" / ", "_").replace(":", "-")
    with contextlib.ExitStack() as stack:
        for i in range(n):
            flags = ("--shard", f"{split.ranges[i][0]}:{split.ranges[i][1]}", "--speed", "1") if split else ()
            cmd = joined(exo_node(lan, i, gguf_path, netem, *flags), groups.get(i, []))
            stack.enter_context(process(cmd, core(i), logs / f"exo-{tag}-{i}.log"))
            if split is None:  # calibrates (node/runtime/calibration.py) while the others idle; its own entry first
                wait_for(
                    f"host {i}'s calibration",
                    lambda i=i: (t := topology(lan, i)) is not None and speed(t["nodes"][0]) > 0,
                )
        wait_exo(lan)
        speeds = None
        if split is None:

            def measured() -> bool:  # every host's speed seen by the entry, and a plan made with them
                t = topology(lan)
                return t is not None and t["plan"] is not None and all(speed(x) > 0 for x in t["nodes"])

            wait_for("every host's measured speed in the entry's plan", measured, 120)
            topo = topology(lan)
            by_id = {nd["node_id"]: speed(nd) for nd in topo["nodes"]}
            speeds, split = tuple(by_id[f"host{i}"] for i in range(n)), planned_split(topo, n)
            print(json.dumps({"planner": split.label, "speeds": speeds}), flush=True)
        got = Outcome(split, measure(lan, model_id, args.rounds, args.tokens), speeds)
    print(json.dumps({"split": got.split.label, "aggregates": got.aggregates, "load": os.getloadavg()[0]}), flush=True)
    return got


def main() -> None:
    from shards.formats.packaged import resolve_model
    from tests.support import cgroups, netns  # the multihost tests' hosts and quotas

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=2, choices=(2, 3))
    ap.add_argument("--slow", type=int, default=1, help="the host held to --quota of a core")
    ap.add_argument("--quota", type=float, default=0.5, help="the slow host's share of one core")
    ap.add_argument("--delay", type=float, default=0.2, help="one-way delay, ms")
    ap.add_argument("--rate", type=float, default=1000, help="link rate, Mbit/s")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--step", type=int, default=1, help="static splits' boundaries every this many layers")
    ap.add_argument("--splits", default="", help="static splits to try instead, like 0:19/19:30,0:15/15:30")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "multihost-placement.md")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    if why := netns.available() or cgroups.available():
        sys.exit(why)
    if not (0 <= args.slow < args.hosts and 0 < args.quota < 1):
        sys.exit(f"--slow must name a host (0-{args.hosts - 1}) and --quota be a share of a core in (0, 1)")
    if args.rounds < 1 or args.tokens < 2:
        sys.exit("--rounds must be at least 1 and --tokens at least 2")
    if not args.no_plot:
        from bench.plots import require

        require()
    gguf_path, model_id = resolve_model("smollm2")
    layers, link = n_layers(gguf_path), Link(args.delay, args.rate)
    try:
        splits = [Split.parse(s) for s in args.splits.split(",")] if args.splits else None
    except ValueError as e:
        sys.exit(str(e))
    splits = splits or static_splits(layers, args.hosts, args.step)
    if any(len(s.ranges) != args.hosts or s.ranges[-1][1] != layers for s in splits):
        sys.exit(f"every split needs {args.hosts} ranges ending at layer {layers}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds the stack below: processes, then namespaces
    logs = Path(tempfile.mkdtemp(prefix="bench-multihost-placement-"))
    print(f"logs: {logs}; {len(splits)} static splits", flush=True)
    period = 100_000
    with contextlib.ExitStack() as stack:
        lan = stack.enter_context(netns.PrivateLan(args.hosts, subnet=84))
        quota = stack.enter_context(cgroups.CpuQuota(round(args.quota * period), period))
        groups = {args.slow: [quota.path]}
        netem = has_netem(lan)
        shape(lan, link, netem, logs / "delay_ms")
        if not netem:
            start_relays(stack, lan, logs)
        planner = run(lan, gguf_path, model_id, None, groups, netem, logs, args)
        statics = [run(lan, gguf_path, model_id, s, groups, netem, logs, args) for s in splits]
    command = "uv run --group bench python -m bench.bench_multihost_placement " + " ".join(sys.argv[1:])
    shared = "each pinned to a core of its own" if args.hosts <= 2 else f"the {args.hosts} hosts share 2 cores"
    head = "\n".join([
        "# Placement by measured speed: the planner's split against every static split",
        "",
        f"Written by `{command.strip()}` (bench/bench_multihost_placement.py: how the hosts and configurations are "
        f"set up). {args.hosts} hosts, each a network namespace, {shared}; host {args.slow} held to "
        f"{args.quota:g} of its core (cgroup CPU quota); {link.label} links, {NETEM if netem else RELAYED}. "
        f"The packaged SmolLM2, exo-node only, every configuration started afresh; {args.rounds} turn(s) of "
        f"{STREAMS} streams x {args.tokens} tokens each. Load average at the end: {os.getloadavg()[0]:.1f}.",
    ])  # fmt: skip
    args.out.write_text(report(planner, statics, head))
    print(f"wrote {args.out}")
    if not args.no_plot:
        print(f"wrote {plot(planner, statics, args.slow, args.quota, args.out.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
