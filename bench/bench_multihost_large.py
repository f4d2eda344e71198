"""A model no node can hold: a 7B-shaped Q4_K_M (bench/large_model.py) served by 3 hosts each capped below it, by
exo-node and then by llama.cpp RPC on the same hosts.

    uv run --group bench python -m bench.bench_multihost_large [--hosts 3] [--memory-gb 2.5] [--cap-gb GB]
        [--delay 0.2] [--rate 1000] [--streams 1] [--tokens 32] [--rounds 1] [--no-rpc] [--llamacpp-bin DIR]

As root (Linux), on bench/multihost_lan.py's hosts (host i on core i modulo the cores: 3 hosts share 2 cores), one
link setting. Every process of host i (its exo node or its RPC worker, on host 0 also llama-server; not its link's
relay) runs inside a cgroup memory limit of `--cap-gb` (default `--memory-gb`), joined before its first
instruction; the model file is larger than any one host's limit, so only a split can serve it. One system at a time, so the caps
hold only its processes:
- exo-node: a node per host, `--memory-gb` (what the planner may give it: weights and a context's KV cache,
  node/core/placement/layer_costs.py) and `--speed 1` (equal hosts, nothing to calibrate), no `--shard`: the
  entry's planner splits the layers within every host's memory;
- llama.cpp RPC: `ggml-rpc-server -t 1` per host, `llama-server -ngl 99 --rpc` on host 0 (its own split, by the
  workers' free memory).
Per system: a warm-up, then `--rounds` turns of each of `--streams` (bench/bench_serve.py's client, on host 0):
decode tok/s at one stream, aggregate at more. Then each host's resident memory (now and peak, /proc/PID/status)
against its share: for exo, its planned layers' bytes in the file (the embedding with the first, the head with the
last); for llama.cpp, the model buffer llama-server reports sending that worker. The goal: exo's peak resident
memory <= 1.1x its share on every host. Writes docs/multihost-large.md (+ .json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.bench_rpc import LLAMACPP_BIN, process
from bench.local_cluster import ROOT
from bench.multihost_lan import (
    EXO_API,
    LLAMA_PORT,
    NETEM,
    RELAYED,
    RPC_PORT,
    Link,
    MemoryCap,
    core,
    exo_node,
    has_netem,
    joined,
    listening,
    ns_get,
    resident,
    rpc_addresses,
    rpc_worker,
    serve,
    shape,
    start_relays,
    topology,
    wait_exo,
    wait_for,
)

GOAL = 1.1  # exo: a host's peak resident memory / its share
SLOT_CONTEXT = 1024  # llama-server's context per parallel slot: the benchmark's prompts and answers fit
RPC_BUFFER = re.compile(r"RPC\d*\[([^\]]+)\] model buffer size =\s*([\d.]+) MiB")


def share_bytes(tensors: dict[str, int], start: int, end: int, n_layers: int) -> int:
    """The file's bytes of layers [start, end): their blocks, the token embedding with layer 0 and the output head
    and norm with the last, which is what a node holding them holds."""
    blocks = {f"blk.{i}." for i in range(start, end)}
    total = 0
    for name, size in tensors.items():
        if name.startswith("blk."):
            total += size if name[: name.index(".", 4) + 1] in blocks else 0
        elif name.startswith("token_embd."):
            total += size if start == 0 else 0
        elif name.startswith("output"):  # output.weight, output_norm.weight
            total += size if end == n_layers else 0
    return total


def rpc_shares(llama_log: str) -> dict[str, int]:
    """Each RPC worker's model buffer (bytes) as llama-server logs it, by address."""
    return {addr: round(float(mib) * 2**20) for addr, mib in RPC_BUFFER.findall(llama_log)}


@dataclass(frozen=True)
class HostMemory:
    """One process's resident memory against the model bytes it was given."""

    host: int
    what: str  # the process and its layers
    share: int | None  # bytes; None: it holds no share (llama-server, an orchestrator)
    rss: int
    peak: int
    planned: int | None = None  # exo: what the planner counted against its memory (weights + a context's KV)

    @property
    def ratio(self) -> float | None:
        return self.peak / self.share if self.share else None


@dataclass(frozen=True)
class SystemRun:
    """One system's turns (bench_serve `concurrent` dicts) and its processes' memory after them."""

    name: str
    turns: tuple[dict, ...]
    memory: tuple[HostMemory, ...]

    def median(self, streams: int) -> float | None:
        got = [t["per_stream" if streams == 1 else "aggregate"] for t in self.turns if t["streams"] == streams]
        return statistics.median(got) if got else None


def report(runs: list[SystemRun], model_bytes: int, head: str, streams: list[int]) -> str:
    gib = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    lines = [head, ""]
    exo = next((r for r in runs if r.name == "exo-node"), None)
    if exo is not None:
        worst = max(m.ratio for m in exo.memory if m.ratio is not None)
        lines += [
            f"**exo-node: the largest peak resident / share on a host {worst:.2f}x "
            f"(goal ≤ {GOAL:.1f}x: {'met' if worst <= GOAL else 'missed'}); the model file {gib(model_bytes)} GiB.**",
            "",
        ]
    lines += ["| | " + " | ".join(r.name for r in runs) + " |", "|---|" + "---|" * len(runs)]
    for s in streams:
        what = "one stream, decode tok/s" if s == 1 else f"{s} streams, aggregate tok/s"
        lines.append(f"| {what} | " + " | ".join(f"{r.median(s):.2f}" for r in runs) + " |")
    lines += [
        "",
        "Share: the bytes of the model the process holds (exo: its planned layers in the file; llama.cpp: the model"
        " buffer llama-server sent it). Planned: what exo's planner counted against the host's --memory-gb for those"
        " layers (their weights and one context's KV cache).",
        "",
        "| system | host | process, layers | share GiB | resident GiB | peak GiB | peak / share | planned GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        for m in r.memory:
            share, planned = (gib(x) if x else "—" for x in (m.share, m.planned))
            ratio = f"{m.ratio:.2f}x" if m.ratio is not None else "—"
            cells = (r.name, m.host, m.what, share, gib(m.rss), gib(m.peak), ratio, planned)
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


# -- running the systems ------------------------------------------------------------------------------------------
def memory_of(proc, host: int, what: str, share: int | None, planned: int | None = None) -> HostMemory:
    if proc.poll() is not None:
        raise RuntimeError(f"{what} on host {host} exited ({proc.returncode}): killed by its memory cap? see its log")
    return HostMemory(host, what, share, *resident(Path(f"/proc/{proc.pid}/status").read_text()), planned)


def turns(lan, url: str, model_id: str, streams: list[int], args) -> tuple[dict, ...]:
    serve(lan, url, model_id, 1, 4, -1)  # warm up: graphs, the first prefill
    got = []
    for r in range(args.rounds):
        for s in streams:
            got.append(serve(lan, url, model_id, s, args.tokens, r))
            print(json.dumps({"url": url, **got[-1]}), flush=True)
    return tuple(got)


def run_exo(lan, gguf_path: Path, model_id: str, tensors: dict[str, int], planned: tuple[int, ...], ctx) -> SystemRun:
    groups, netem, logs, args, streams = ctx
    with contextlib.ExitStack() as stack:
        procs = []
        for i in range(len(lan.hosts)):
            node = exo_node(lan, i, gguf_path, netem, "--memory-gb", f"{args.memory_gb:g}", "--speed", "1")
            procs.append(stack.enter_context(process(joined(node, groups[i]), core(i), logs / f"exo-{i}.log")))
        wait_exo(lan, 1800)
        done = turns(lan, f"http://127.0.0.1:{EXO_API}", model_id, streams, args)
        plan = {s["node_id"]: (s["start"], s["end"]) for s in topology(lan)["plan"]}
        memory = []
        for i, proc in enumerate(procs):
            start, end = plan.get(f"host{i}", (0, 0))
            share = share_bytes(tensors, start, end, len(planned)) if end > start else None
            memory.append(memory_of(proc, i, f"node, layers {start}:{end}", share, sum(planned[start:end])))
    return SystemRun("exo-node", done, tuple(memory))


def run_rpc(lan, gguf_path: Path, model_id: str, ctx) -> SystemRun:
    groups, netem, logs, args, streams = ctx
    n, bin_dir, slots = len(lan.hosts), args.llamacpp_bin, max(streams)
    with contextlib.ExitStack() as stack:
        workers = [
            stack.enter_context(process(joined(rpc_worker(lan, i, bin_dir), groups[i]), core(i), logs / f"rpc-{i}.log"))
            for i in range(n)
        ]
        for i in range(n):  # llama-server aborts if a worker isn't there yet
            wait_for(f"ggml-rpc-server on host {i}", lambda i=i: listening(lan, i, RPC_PORT + i))
        addresses = rpc_addresses(lan, netem)
        llama = [str(bin_dir / "llama-server"), "-m", str(gguf_path), "-t", "1", "-np", str(slots)]
        llama += ["-c", str(slots * SLOT_CONTEXT), "--host", "127.0.0.1", "--port", str(LLAMA_PORT)]
        llama += ["-ngl", "99", "--rpc", ",".join(addresses), "-lv", "4"]  # 4: the loader's buffer sizes too
        server = stack.enter_context(process(joined(lan.exec(0, *llama), groups[0]), core(0), logs / "llama.log"))
        url = f"http://127.0.0.1:{LLAMA_PORT}"
        wait_for("llama-server", lambda: ns_get(lan, 0, f"{url}/health") is not None, 1800)
        done = turns(lan, url, model_id, streams, args)
        shares = rpc_shares((logs / "llama.log").read_text())
        memory = [memory_of(w, i, "ggml-rpc-server", shares.get(addresses[i])) for i, w in enumerate(workers)]
        memory.append(memory_of(server, 0, "llama-server (orchestrator; the token embedding)", None))
    return SystemRun("llama.cpp RPC", done, tuple(memory))


def main() -> None:
    import gguf

    from bench.large_model import large_gguf
    from node.core.placement.layer_costs import file_bytes_per_param, layer_footprints
    from shards.engines.ggml.engine import GgmlEngine
    from shards.formats.loader import load_config
    from shards.formats.packaged import model_id as model_id_of
    from tests.support import netns  # the multihost tests' hosts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a GGUF (default: bench/large_model.py's, made if missing)")
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--memory-gb", type=float, default=2.5, help="what each exo node reports (--memory-gb)")
    ap.add_argument("--cap-gb", type=float, help="each host's cgroup memory limit (default: --memory-gb)")
    ap.add_argument("--delay", type=float, default=0.2, help="one-way delay, ms")
    ap.add_argument("--rate", type=float, default=1000, help="link rate, Mbit/s")
    ap.add_argument("--streams", default="1", help="stream counts, like 1,8")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-rpc", action="store_true", help="exo-node only")
    ap.add_argument("--llamacpp-bin", type=Path, default=LLAMACPP_BIN, help="llama.cpp's build/bin folder")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "multihost-large.md")
    args = ap.parse_args()
    if why := netns.available():
        sys.exit(why)
    streams = sorted({int(s) for s in args.streams.split(",")})
    if args.hosts < 2 or args.rounds < 1 or args.tokens < 3 or streams[0] < 1:
        sys.exit("--hosts must be at least 2, --rounds 1, --tokens 3 and every --streams count 1")
    gguf_path = args.model or large_gguf(args.llamacpp_bin)
    cap = int((args.cap_gb or args.memory_gb) * 2**30)
    model_bytes = gguf_path.stat().st_size
    if cap >= model_bytes or args.memory_gb * 2**30 >= model_bytes:
        sys.exit(
            f"each host must be capped below the model ({model_bytes / 2**30:.2f} GiB): lower --memory-gb/--cap-gb"
        )
    reader = gguf.GGUFReader(gguf_path)
    tensors = {t.name: int(t.n_bytes) for t in reader.tensors}
    cfg = load_config(
        gguf_path
    )  # the planner's footprints, as the entry node works them out (node/runtime/planning.py)
    bpp, kv_tokens = file_bytes_per_param(gguf_path, cfg), cfg.max_position_embeddings
    planned = layer_footprints(cfg, bytes_per_param=bpp, kv_tokens=kv_tokens, kv_value_bytes=GgmlEngine.kv_value_bytes)
    n_layers = cfg.n_layers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds the stack below: processes, then namespaces
    logs = Path(tempfile.mkdtemp(prefix="bench-multihost-large-"))
    print(f"logs: {logs}", flush=True)
    link, runs = Link(args.delay, args.rate), []
    with contextlib.ExitStack() as stack:
        lan = stack.enter_context(netns.PrivateLan(args.hosts, subnet=85))
        caps = [stack.enter_context(MemoryCap(cap)) for _ in range(args.hosts)]
        groups = {i: [c.path] for i, c in enumerate(caps)}
        netem = has_netem(lan)
        shape(lan, link, netem, logs / "delay_ms")
        if not netem:
            start_relays(stack, lan, logs)
        ctx = (groups, netem, logs, args, streams)
        runs.append(run_exo(lan, gguf_path, model_id_of(gguf_path), tensors, planned, ctx))
        if not args.no_rpc:
            runs.append(run_rpc(lan, gguf_path, model_id_of(gguf_path), ctx))
    command = "uv run --group bench python -m bench.bench_multihost_large " + " ".join(sys.argv[1:])
    shared = "each on a core of its own" if args.hosts <= (os.cpu_count() or 1) else "sharing the machine's cores"
    head = "\n".join([
        "# A model no node can hold: a 7B-shaped Q4_K_M on 3 capped hosts",
        "",
        f"Written by `{command.strip()}` (bench/bench_multihost_large.py: how the hosts and systems are set up). "
        f"{gguf_path.name}: {model_bytes / 2**30:.2f} GiB, {n_layers} layers. {args.hosts} hosts, each a network "
        f"namespace, {shared}, each held to {cap / 2**30:.2f} GiB (cgroup memory limit) with exo's --memory-gb "
        f"{args.memory_gb:g}; {link.label} links, {NETEM if netem else RELAYED}. One system at a time; "
        f"{args.rounds} round(s) of {args.tokens} tokens. Load average at the end: {os.getloadavg()[0]:.1f}.",
    ])  # fmt: skip
    args.out.write_text(report(runs, model_bytes, head, streams))
    args.out.with_suffix(".json").write_text(json.dumps([asdict(r) for r in runs], indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
