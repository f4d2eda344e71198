"""exo-node against llama-server, the same asyncio client on both, the same GGUF file and threads.

    uv run python -m bench.bench_serve [--llama-server /tmp/ref/llama.cpp/build/bin/llama-server]
        [--streams 1,4,8,16] [--tokens 128] [--turns 6] [--answer 200] [--threads 2] [--servers exo1,exo3]
        [--exo-args "--quantize none"] [--model FILE.gguf] [--sampling greedy|openai|ollama] [--cold] [--out bench-serve.json]

Servers, all started at once and idle while another is measured: llama-server (`-np 8 -t THREADS`, when the binary
is there), one exo node (default engine) and a 3-node exo ring on loopback (bench/local_cluster.py). Each round of a
stream count runs on every server in turn, in an order rotated from round to round. The model is the packaged SmolLM2 GGUF, its Q4_1
blocks on both (exo serves this file as F16 unless told otherwise, so --exo-args defaults to "--quantize none").

Two measurements per server:
- streams: N concurrent streaming chat requests (greedy unless --sampling names a client's defaults, --tokens each,
  different prompts), started together, --rounds times with new prompts each round (the median round is reported, all rounds listed);
  aggregate tok/s = all tokens (the usage each stream reports) / wall time from the first request to the last token; per-stream tok/s = each
  stream's tokens after its first / the time between its first and last token, averaged.
- multi-turn: one conversation (a ~120-token system prompt, --turns user turns, answers of up to --answer tokens),
  each turn resending the whole conversation; the time to first token of every turn. With prefix reuse (llama-
  server's slot cache, exo's retained prefixes) turn 6 should cost about what turn 1 does; --cold also runs it with
  a new session number at the start of every turn, so nothing can be reused (the cost without prefix caching).

The load average is recorded with every figure (the machine may be shared: compare within a run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp

from bench.local_cluster import Cluster, free_port, wait_settled
from shards.formats.loader import load_config
from shards.formats.packaged import model_id as packaged_id
from shards.formats.packaged import resolve_model

SYSTEM = (
    "You are a careful assistant for a small team of engineers. Answer in plain English, keep answers "
    "short and concrete, prefer lists when steps are involved, say so when you are unsure, never invent "
    "version numbers or command-line flags, and when code is asked for give a complete, runnable snippet "
    "with a one-line explanation of what it does. The team works on a distributed inference system written "
    "in Python that runs language models across several machines on a home network."
)
QUESTIONS = [
    "What is a KV cache?",
    "Why does it grow with the conversation?",
    "How can a server reuse it?",
    "What happens when memory runs out?",
    "Give me a short example in Python.",
    "Summarise all of that.",
]
# What a request asks of the sampler: every field spelled out, so llama-server's own defaults (top_k 40, min_p
# 0.05) don't apply on one side only. openai: the OpenAI API's defaults; ollama: Ollama's (and Open WebUI's through it).
SAMPLING = {
    "greedy": {"temperature": 0},
    "openai": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0},
    "ollama": {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.0, "repeat_penalty": 1.1, "repeat_last_n": 64},
}
TOPICS = ["the sea", "a mountain", "a city at night", "a forest", "the desert", "a river", "snow", "the moon"]


async def stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    messages: list[dict],
    max_tokens: int,
    sampling: str = "greedy",
) -> dict:
    """One streaming chat completion: when it was sent, each content chunk's arrival, and the text."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        **SAMPLING[sampling],
        "stream": True,
        "stream_options": {"include_usage": True},  # a chunk may carry several tokens (speculative decoding)
    }
    sent, stamps, text, tokens = time.perf_counter(), [], [], None
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            choices = event.get("choices") or [{}]
            piece = (choices[0].get("delta") or {}).get("content")
            if piece:
                stamps.append(time.perf_counter())
                text.append(piece)
    return {"sent": sent, "stamps": stamps, "text": "".join(text), "tokens": tokens or len(stamps)}


async def concurrent(
    url: str, model: str, streams: int, tokens: int, round_: int = 0, sampling: str = "greedy"
) -> dict:
    """N streams at once; each round asks for other stories (a new prompt: nothing the server cached is reused)."""
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        runs = await asyncio.gather(
            *(
                stream_chat(
                    session,
                    url,
                    model,
                    [
                        {
                            "role": "user",
                            "content": f"Write a long story about {TOPICS[i % len(TOPICS)]} ({i}, {round_}).",
                        }
                    ],
                    tokens,
                    sampling,
                )
                for i in range(streams)
            )
        )
    end = max(r["stamps"][-1] for r in runs if r["stamps"])
    # tokens from each stream's usage (one content chunk may carry several tokens); a server that sends no usage
    # is counted by its chunks
    chunks = sum(r["tokens"] for r in runs)
    per_stream = [(r["tokens"] - 1) / (r["stamps"][-1] - r["stamps"][0]) for r in runs if len(r["stamps"]) > 2]
    return {
        "streams": streams,
        "aggregate": chunks / (end - start),
        "per_stream": sum(per_stream) / len(per_stream) if per_stream else float("nan"),  # too few chunks to time
        "ttft": sum(r["stamps"][0] - r["sent"] for r in runs) / len(runs),
        "chunks": chunks,
        "load": os.getloadavg()[0],
    }


async def multi_turn(url: str, model: str, turns: int, answer: int, cold: bool = False) -> dict:
    """`cold`: every turn's conversation starts with a new session number, so no server can reuse a prefix: the
    same work without prefix caching, for comparison."""
    messages = [{"role": "system", "content": SYSTEM}]
    ttft = []
    # a fresh connection per request: a server may close an idle keep-alive connection between turns
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=1800), connector=aiohttp.TCPConnector(force_close=True)
    ) as session:
        for t in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
            sent = (
                [{"role": "system", "content": f"Session {t + 1}{t * 7919 % 1000}. {SYSTEM}"}, *messages[1:]]
                if cold
                else messages
            )
            run = await stream_chat(session, url, model, sent, answer)
            ttft.append(run["stamps"][0] - run["sent"] if run["stamps"] else float("nan"))
            messages.append({"role": "assistant", "content": run["text"]})
    return {"ttft": ttft, "load": os.getloadavg()[0]}


def wait_http(url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not become healthy in {timeout:g}s")


def measure(servers: dict[str, tuple[str, str]], args) -> list[dict]:
    """Every server (name -> (url, model)) on the same rounds: each round of a stream count runs on every server in
    turn, the order rotated from round to round, so a machine whose speed drifts weighs on all alike; the idle
    servers wait (a second's pause before each run lets the last one's threads stop spinning)."""
    names = list(servers)
    for url, model in servers.values():
        asyncio.run(concurrent(url, model, 1, 4, -1))  # warm up (a prompt no round asks)
    for name, (url, _) in servers.items():  # then what an exo node does once after its first request
        if name.startswith("exo"):
            wait_settled(url)
    out = {name: {"server": name, "streams": [], "multi_turn": None} for name in names}
    for n in args.streams:
        rounds: dict[str, list[dict]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                time.sleep(1)
                rounds[name].append(asyncio.run(concurrent(*servers[name], n, args.tokens, r, args.sampling)))
        for name in names:
            row = sorted(rounds[name], key=lambda r: r["aggregate"])[len(rounds[name]) // 2]  # the median round
            row["rounds"] = [round(r["aggregate"], 1) for r in rounds[name]]
            out[name]["streams"].append(row)
            print(
                f"{name}: {n:2d} streams: {row['aggregate']:6.1f} tok/s aggregate, {row['per_stream']:6.1f} per "
                f"stream, TTFT {row['ttft']:.2f}s (load {row['load']:.1f}; rounds {row['rounds']})",
                flush=True,
            )
    for name in names:
        for key, cold in (("multi_turn", False), ("multi_turn_cold", True)):
            if cold and not args.cold:
                continue
            time.sleep(1)
            out[name][key] = asyncio.run(multi_turn(*servers[name], args.turns, args.answer, cold))
            print(
                f"{name}: multi-turn TTFT per turn{' (no prefix can be reused)' if cold else ''}: "
                f"{', '.join(f'{t:.2f}' for t in out[name][key]['ttft'])} s (load {out[name][key]['load']:.1f})",
                flush=True,
            )
    return [out[name] for name in names]


@contextlib.contextmanager
def llama_server(binary: Path, gguf: Path, args) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            str(binary),
            "-m",
            str(gguf),
            "-np",
            "8",
            "-t",
            str(args.threads),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-c",
            str(8 * 2048),
        ],
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
def exo(nodes: int, model: Path, model_id: str, args) -> Iterator[str]:
    layers = load_config(model).n_layers
    cuts = [round(i * layers / nodes) for i in range(nodes + 1)]
    shards = [f"{a}:{b}" for a, b in zip(cuts, cuts[1:])] if nodes > 1 else None
    extra = shlex.split(args.exo_args) + (
        ["--threads", str(max(1, args.threads // nodes))] if nodes > 1 else ["--threads", str(args.threads)]
    )
    with Cluster(model, nodes, shards=shards, api_nodes=1, model_id=model_id, engine=None, extra=extra) as c:
        yield c.nodes[0].api_url


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-server", type=Path, default=Path("/tmp/ref/llama.cpp/build/bin/llama-server"))
    ap.add_argument("--streams", default="1,4,8,16", help="stream counts to sweep ('' for none)")
    ap.add_argument("--cold", action="store_true", help="also the multi-turn chat with nothing reusable")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per stream count; the median is reported")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--answer", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--exo-args",
        default="--quantize none",
        help="exo node flags (default: the file's own Q4_1 blocks, as llama-server reads them)",
    )
    ap.add_argument("--servers", default="llama-server,exo1,exo3", help="which of llama-server, exo1, exo3 to run")
    ap.add_argument(
        "--sampling", choices=sorted(SAMPLING), default="greedy", help="the streams' sampling parameters (SAMPLING)"
    )
    ap.add_argument("--model", type=Path, help="a GGUF file both serve instead of the packaged SmolLM2")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.streams = [int(s) for s in args.streams.split(",") if s]
    model, model_id = (args.model, packaged_id(args.model)) if args.model else resolve_model("smollm2")
    print(
        f"model {model.name}; sampling {args.sampling} {SAMPLING[args.sampling]}; load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    wanted = args.servers.split(",")
    with contextlib.ExitStack() as stack:
        servers: dict[str, tuple[str, str]] = {}
        if "llama-server" in wanted:
            if args.llama_server.exists():
                servers["llama-server"] = (stack.enter_context(llama_server(args.llama_server, model, args)), "smollm2")
            else:
                print(f"llama-server: {args.llama_server} is not there (build it: see docs/benchmarks.md); skipped")
        for n in (1, 3):
            if f"exo{n}" in wanted:
                url = stack.enter_context(exo(n, model, model_id, args))
                servers[f"exo {n} node{'s' if n > 1 else ''}"] = (url, model_id)
        results = measure(servers, args)
    print("\n| server | " + " | ".join(f"{n} streams agg (per stream)" for n in args.streams) + " |")
    print("|---|" + "---|" * len(args.streams))
    for r in results:
        print(
            f"| {r['server']} | "
            + " | ".join(f"{s['aggregate']:.0f} ({s['per_stream']:.0f})" for s in r["streams"])
            + " |"
        )
    print("\n| server | TTFT per turn (s) | without a reusable prefix |\n|---|---|---|")
    for r in results:
        cold = r.get("multi_turn_cold")
        print(
            f"| {r['server']} | {', '.join(f'{t:.2f}' for t in r['multi_turn']['ttft'])} | "
            f"{', '.join(f'{t:.2f}' for t in cold['ttft']) if cold else '-'} |"
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
