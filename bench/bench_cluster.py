"""Decode speed through the HTTP API: one node holding the whole model vs a 3-node loopback pipeline.

    uv run python -m bench.bench_cluster [--tokens 64]

Writes the mid-size random Llama (357.6M params, f32) to a temp folder and streams greedy completions, timing the gap between the first and the last token.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.random_model import write_random_llama
from tests.cluster import Cluster


def stream_decode_rate(api_url: str, model: str, prompt: str, tokens: int) -> tuple[int, float]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
                       "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(f"{api_url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    stamps = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {") and b'"content"' in line and b'"role"' not in line:
                stamps.append(time.perf_counter())
    # content chunks can merge tokens (held-back UTF-8) but rarely; count chunks as tokens
    return len(stamps), (len(stamps) - 1) / (stamps[-1] - stamps[0])


def run(model: Path, n: int, shards: list[str] | None, tokens: int, concurrent: int = 1,
        extra: list[str] | None = None) -> float:
    with Cluster(model, n, shards=shards, api_nodes=1, extra=extra) as c:
        stream_decode_rate(c.nodes[0].api_url, model.name, "warm up", 4)
        if concurrent == 1:
            rates = [stream_decode_rate(c.nodes[0].api_url, model.name, f"prompt {i}", tokens)[1] for i in range(3)]
            return statistics.median(rates)
        with ThreadPoolExecutor(concurrent) as pool:
            t = time.perf_counter()
            counts = list(pool.map(lambda i: stream_decode_rate(c.nodes[0].api_url, model.name, f"p{i}", tokens)[0],
                                   range(concurrent)))
            return sum(counts) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--sampling-ab", action="store_true",
                    help="only compare 8 concurrent streams on 3 nodes with the sampling batcher on vs off")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_random_llama(Path(tmp) / "mid")
        if args.sampling_ab:
            shards = ["0:3", "3:6", "6:8"]
            for label, extra in (("on", None), ("off", ["--sample-batch-max", "1"]), ("on", None)):
                agg = run(model, 3, shards, args.tokens, concurrent=8, extra=extra)
                print(f"3 nodes, 8 concurrent streams, sampling batcher {label}: {agg:.1f} tok/s aggregate")
            return
        one = run(model, 1, None, args.tokens)
        print(f"1 node : {one:.1f} tok/s decode (one stream)")
        three = run(model, 3, ["0:3", "3:6", "6:8"], args.tokens)
        print(f"3 nodes: {three:.1f} tok/s decode (one stream), {three / one:.2f}x single node, "
              f"{1000 / three - 1000 / one:+.1f} ms/token overhead")
        for n, shards in ((1, None), (3, ["0:3", "3:6", "6:8"])):
            agg = run(model, n, shards, args.tokens, concurrent=8)
            print(f"{n} node(s), 8 concurrent streams: {agg:.1f} tok/s aggregate (incl. prefill)")


if __name__ == "__main__":
    main()
