"""Prefill speed: time to the first token of one prompt at a time, exo-node against llama-server, the same GGUF file
and threads, at several prompt lengths, in alternated rounds of one run.

    uv run python -m bench.bench_prefill [--lengths 256,1024,2048,4096,8000] [--rounds 3] [--threads 2]
        [--llama-server PATH] [--servers llama-server,exo,exo-q4_1] [--decode 32] [--out bench-prefill.json]

Servers, all started at once and idle while another is measured: llama-server (`-np 1 -c 8192 -t/-tb THREADS`, when
the binary is there), one exo node with its default settings (`exo`: the packaged SmolLM2 served as F16) and one
with `--quantize none` (`exo-q4_1`: the file's own Q4_1 blocks, as llama-server reads them), each `--threads
THREADS`; `exo-gemm` (asked for by name) is the defaults with `--attention gemm`. Every request is a fresh prompt of exactly that many token ids (random ids, seeded by round, length and
server: no server can reuse a prefix) sent to /v1/completions with max_tokens 1, so the time to the answer is the
prefill plus one token's step (tens of ms). Each round measures every length on every server, the servers in a
rotated order, so a machine whose speed drifts weighs on all alike; a figure is the median round. Before the rounds
each server answers a warm-up prompt and each exo node ends its start-up work (its draft rows priced once idle:
bench/local_cluster.py `wait_settled`), and a second's pause comes before every request, so that no server's
leftover work (threads still spinning after a request) lands in another's time. SmolLM2's context is 8,192
positions: the longest prompt leaves room for the answer.

With --decode N, each measured prompt is sent again at once, streamed, for N tokens (greedy, the end-of-text tokens
banned by logit_bias so every answer runs its length; both servers keep the prompt from the first request, so this
one prefills a token or two): its decode speed at that depth is (N - 1) tokens over the time from its first
streamed token to its last.

The load average is recorded with every figure (the machine may be shared: compare within a run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from bench.bench_serve import wait_http
from bench.local_cluster import Cluster, free_port, http, wait_settled
from shards.formats.loader import load_config
from shards.formats.packaged import resolve_model

LLAMA_SERVER = Path("/opt/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server")
CONTEXT = 8192  # SmolLM2's
EXO = {"exo": [], "exo-q4_1": ["--quantize", "none"], "exo-gemm": ["--attention", "gemm"]}  # name -> node flags
TIMEOUT = 3600  # seconds one request may take (a long prompt on a slow prefill)
PAUSE_S = 1.0  # before each request: the last server's threads stop spinning (ggml's and llama.cpp's poll a while)


def prompt(length: int, seed: int) -> list[int]:
    """`length` token ids no earlier request began with."""
    return np.random.default_rng(seed).integers(100, 5000, length).tolist()


def ttft(url: str, model: str, ids: list[int]) -> float:
    """Seconds from sending `ids` to the whole answer of one token; checks the server prefilled every id."""
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    status, out = http("POST", f"{url}/v1/completions", body, timeout=TIMEOUT)
    seconds = time.perf_counter() - t0
    if status != 200:
        raise RuntimeError(f"{url}: HTTP {status}: {json.dumps(out)[:300]}")
    took = (out.get("usage") or {}).get("prompt_tokens")
    if took not in (len(ids), len(ids) + 1):  # llama-server may count a BOS it adds
        raise RuntimeError(f"{url}: prefilled {took} tokens of a {len(ids)}-token prompt")
    return seconds


def decode_rate(url: str, model: str, ids: list[int], n: int, banned: list[int]) -> float:
    """Tokens a second after `ids`: a streamed completion of `n` tokens, its first token's arrival to its last's."""
    body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "stream": True}
    body["logit_bias"] = {str(t): -100 for t in banned}
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    arrivals = []
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        for line in r:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    arrivals.append(time.perf_counter())
    if len(arrivals) < n // 2:
        raise RuntimeError(f"{url}: {len(arrivals)} tokens streamed of {n}")
    return (n - 1) / (arrivals[-1] - arrivals[0])


@contextlib.contextmanager
def llama_server(binary: Path, gguf: Path, threads: int):
    """One slot holding the model's whole context, so the longest prompt fits."""
    port = free_port()
    flags = ["-np", "1", "-c", str(CONTEXT), "-t", str(threads), "-tb", str(threads)]
    proc = subprocess.Popen(
        [str(binary), "-m", str(gguf), *flags, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.contextmanager
def exo_node(model: Path, model_id: str, flags: list[str], threads: int):
    extra = [*flags, "--threads", str(threads)]
    with Cluster(model, 1, api_nodes=1, model_id=model_id, engine=None, extra=extra) as c:
        yield c.nodes[0].api_url


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    ap.add_argument("--lengths", default="256,1024,2048,4096,8000", help="prompt lengths in tokens")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the median round's time is reported")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--servers", default="llama-server,exo,exo-q4_1", help="which of llama-server, exo, exo-q4_1, exo-gemm"
    )
    ap.add_argument("--decode", type=int, default=0, help="also each prompt's decode tok/s over this many tokens")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",") if n]
    if not lengths or min(lengths) < 1 or max(lengths) >= CONTEXT:
        ap.error(f"--lengths must be positive and below the context of {CONTEXT} (room for the answer)")
    model, model_id = resolve_model("smollm2")
    banned = sorted({int(t) for t in load_config(model).eos_token_ids})
    wanted = args.servers.split(",")
    if unknown := set(wanted) - {"llama-server", *EXO}:
        ap.error(f"unknown servers {sorted(unknown)}: choose from llama-server, {', '.join(EXO)}")
    print(f"model {model.name}; threads {args.threads}; load {os.getloadavg()[0]:.1f}", flush=True)
    with contextlib.ExitStack() as stack:
        urls: dict[str, tuple[str, str]] = {}
        if "llama-server" in wanted:
            if args.llama_server.exists():
                urls["llama-server"] = (stack.enter_context(llama_server(args.llama_server, model, args.threads)), "")
            else:
                print(f"llama-server: {args.llama_server} is not there (build it: see docs/benchmarks.md); skipped")
        for name, flags in EXO.items():
            if name in wanted:
                urls[name] = (stack.enter_context(exo_node(model, model_id, flags, args.threads)), model_id)
        names = list(urls)
        for i, name in enumerate(names):  # warm up: graphs, pages, the first request's own costs
            ttft(*urls[name], prompt(16, 10**6 + i))
        for name in names:  # then what an exo node does once after its first request (its draft rows priced)
            if name in EXO:
                wait_settled(urls[name][0])
        times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in lengths} for name in names}
        rates: dict[str, dict[int, list[float]]] = {name: {n: [] for n in lengths} for name in names}
        loads = []
        for r in range(args.rounds):
            for li, n in enumerate(lengths):
                order = names[(r + li) % len(names) :] + names[: (r + li) % len(names)]
                for name in order:
                    ids = prompt(n, (r * 100_000 + n) * 10 + names.index(name))
                    time.sleep(PAUSE_S)
                    seconds = ttft(*urls[name], ids)
                    times[name][n].append(seconds)
                    loads.append(os.getloadavg()[0])
                    print(f"round {r} {name}: {n} tokens {seconds:.2f} s ({n / seconds:.0f} tok/s)", flush=True)
                    if args.decode:
                        rates[name][n].append(decode_rate(*urls[name], ids, args.decode, banned))
                        print(f"round {r} {name}: decode after {n} tokens {rates[name][n][-1]:.1f} tok/s", flush=True)
    table = {name: {n: statistics.median(ts) for n, ts in by_len.items()} for name, by_len in times.items()}
    print(f"\nprefill tok/s, median of {args.rounds} rounds (load {min(loads):.1f}-{max(loads):.1f})")
    print("| prompt tokens | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    ref = table.get("llama-server")
    for n in lengths:
        cells = []
        for name in names:
            cell = f"{n / table[name][n]:.0f} ({table[name][n]:.2f} s)"
            if ref and name != "llama-server":
                cell += f" {ref[n] / table[name][n]:.2f}x"
            cells.append(cell)
        print(f"| {n:,} | " + " | ".join(cells) + " |")
    if args.decode:
        print(f"\ndecode tok/s after the prompt ({args.decode} tokens), median of {args.rounds} rounds")
        print("| prompt tokens | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
        speed = {name: {n: statistics.median(rs) for n, rs in by_len.items()} for name, by_len in rates.items()}
        for n in lengths:
            cells = [f"{speed[name][n]:.1f}" for name in names]
            if "llama-server" in speed:
                cells = [
                    c + ("" if name == "llama-server" else f" {speed[name][n] / speed['llama-server'][n]:.2f}x")
                    for c, name in zip(cells, names)
                ]
            print(f"| {n:,} | " + " | ".join(cells) + " |")
    if args.out:
        out = {"threads": args.threads, "loads": loads, "seconds": times, "decode_tok_s": rates}
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
