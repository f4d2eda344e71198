"""Two one-core machines: exo-node's 2-node ring against llama.cpp RPC, and each against its one machine.

    uv run python -m bench.bench_rpc [--llamacpp-bin DIR] [--streams 1,8] [--tokens 96] [--rounds 3] [--keep-awake]
        [--no-link-too]

Every process is pinned to a core (`taskset`, Linux) so that core 0 and core 1 stand for two machines on a LAN
(loopback here). All four systems are started at once and stay idle between their turns (no thread spins while
a server waits for requests), so each round measures them back to back in alternating order:
- llama.cpp, one machine: `llama-server -t 1` on core 0;
- llama.cpp RPC, two machines: `ggml-rpc-server -t 1` on core 0 and on core 1, `llama-server -ngl 99 --rpc` on
  core 0 (it only orchestrates: every layer runs on the RPC servers);
- exo-node, one machine: one node, `--threads 1 --quantize none`, on core 0;
- exo-node, two machines: `--shard 0:18` on core 0 and `18:30` on core 1 (the planner's split for two such nodes:
  SmolLM2's output head costs about five layers' work here, so the last node takes fewer), the entry on the first;
- with `--keep-awake`, the same two machines again with that flag: their idle cores spin at the lowest priority
  while they serve (node/runtime/keep_awake.py), which llama.cpp RPC's processes don't do;
- with `--no-link-too`, the same two machines again with `--no-link`: activations and tokens on gRPC's stream, not
  on the data link (node/grpc/link/).
The same GGUF file (the packaged SmolLM2 Q4_1) and bench/bench_serve.py's asyncio client (greedy streams, new
prompts every round). Prints one JSON line per system, stream count and round, then the medians and ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench.bench_microbatch import SPLIT, pin
from bench.bench_serve import concurrent, wait_http
from bench.local_cluster import Cluster, free_port, wait_settled
from shards.formats.packaged import resolve_model

LLAMACPP_BIN = Path("/opt/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin")


@contextlib.contextmanager
def process(cmd: list[str], core: int, log: Path | None = None):
    """`cmd` running with every thread on `core`, its output in `log` (or dropped); terminated on exit."""
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        pin(proc.pid, core)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log:
            out.close()


def llama_server(binary: Path, gguf: Path, port: int, rpc: list[str] | None) -> list[str]:
    cmd = [str(binary), "-m", str(gguf), "-t", "1", "-np", "8", "-c", str(8 * 2048)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    return cmd + (["-ngl", "99", "--rpc", ",".join(rpc)] if rpc else [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llamacpp-bin", type=Path, default=LLAMACPP_BIN, help="llama.cpp's build/bin folder")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--keep-awake",
        action="store_true",
        help="also run exo's two machines with --keep-awake (node/runtime/keep_awake.py)",
    )
    ap.add_argument(
        "--no-link-too",
        action="store_true",
        help="also run exo's two machines with --no-link (the data path on gRPC's stream: node/grpc/link/)",
    )
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    gguf, model_id = resolve_model("smollm2")
    for name in ("llama-server", "ggml-rpc-server"):
        if not (args.llamacpp_bin / name).exists():
            sys.exit(f"{args.llamacpp_bin / name} is missing: build llama.cpp with -DGGML_RPC=ON (docs/benchmarks.md)")

    extra = ["--quantize", "none", "--threads", "1"]
    with contextlib.ExitStack() as stack:
        urls: dict[str, tuple[str, str]] = {}
        rpc = [free_port(), free_port()]
        for core, port in enumerate(rpc):
            cmd = [str(args.llamacpp_bin / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", "1"]
            stack.enter_context(process(cmd, core))
        for name, hosts in (("llama.cpp 1 machine", None), ("llama.cpp RPC 2 machines", rpc)):
            port = free_port()
            peers = [f"127.0.0.1:{p}" for p in hosts] if hosts else None
            stack.enter_context(process(llama_server(args.llamacpp_bin / "llama-server", gguf, port, peers), 0))
            urls[name] = (f"http://127.0.0.1:{port}", "smollm2")
        exos = [("exo 1 machine", 1, []), ("exo 2 machines", 2, [])]
        exos += [("exo 2 machines --keep-awake", 2, ["--keep-awake"])] if args.keep_awake else []
        exos += [("exo 2 machines --no-link", 2, ["--no-link"])] if args.no_link_too else []
        for name, n, more in exos:
            c = stack.enter_context(
                Cluster(
                    gguf,
                    n,
                    shards=SPLIT if n == 2 else None,
                    api_nodes=1,
                    model_id=model_id,
                    engine=None,
                    extra=extra + more,
                )
            )
            for core, node in enumerate(c.nodes):
                pin(node.proc.pid, core)
            urls[name] = (c.nodes[0].api_url, model_id)
        for name, (url, model) in urls.items():
            if name.startswith("llama"):
                wait_http(url)
            asyncio.run(concurrent(url, model, 1, 4, -1))  # warm up: graphs, the first prefill
            asyncio.run(concurrent(url, model, 8, 16, -2))
            if name.startswith("exo"):  # then what an exo node does once after its first request
                wait_settled(url)

        results: dict[tuple[str, int], list[dict]] = {}
        order = list(urls)
        for r in range(args.rounds):
            for n in streams:
                for name in order if r % 2 == 0 else order[::-1]:  # alternate who goes first
                    url, model = urls[name]
                    got = asyncio.run(concurrent(url, model, n, args.tokens, r))
                    results.setdefault((name, n), []).append(got)
                    print(json.dumps({"system": name, "streams": n, "round": r, **_short(got)}), flush=True)

    print("\nmedian of rounds (tok/s):")
    med = {k: statistics.median(g["per_stream" if k[1] == 1 else "aggregate"] for g in v) for k, v in results.items()}
    for n in streams:
        what = "one stream" if n == 1 else f"{n} streams aggregate"
        for name in urls:
            print(f"  {what:<22} {name:<26} {med[(name, n)]:7.1f}")
        print(
            f"  {what}: exo 2 machines / llama.cpp RPC = {med[('exo 2 machines', n)] / med[('llama.cpp RPC 2 machines', n)]:.2f}x; "
            f"exo 2/1 machines = {med[('exo 2 machines', n)] / med[('exo 1 machine', n)]:.2f}x; "
            f"RPC 2/1 = {med[('llama.cpp RPC 2 machines', n)] / med[('llama.cpp 1 machine', n)]:.2f}x"
        )
        for flag in ("--keep-awake", "--no-link"):
            if (f"exo 2 machines {flag}", n) in med:
                other = med[(f"exo 2 machines {flag}", n)] / med[("llama.cpp RPC 2 machines", n)]
                print(f"  {what}: exo 2 machines {flag} / llama.cpp RPC = {other:.2f}x")


def _short(got: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in got.items()}


if __name__ == "__main__":
    main()
