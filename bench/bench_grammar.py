"""Grammar-constrained sampling: what a JSON schema costs.

    uv run python -m bench.bench_grammar [--engine ggml] [--streams 8]

1. On the entry: time to compile and check a 20-field schema against SmolLM2's vocabulary (shards/grammar.py),
   and to build a request's matcher; per token, a mask (computed on the grammar thread) and its application.
2. On a live single node serving the packaged SmolLM2: decode tok/s of a constrained stream vs an unconstrained
   one, alone and with `--streams` concurrent streams of the same kind, and the time to first token of a request
   carrying the 20-field schema (its grammar compiled at the entry) vs one without.
Decode tok/s = (completion tokens - 1) / (last chunk - first chunk), from the stream's usage chunk.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.local_cluster import Cluster
from shards.formats.packaged import resolve_model
from shards.grammar import Constraint, Matcher, grammar_tokenizer, json_schema_grammar
from shards.tokenizer import Tokenizer

MODEL = "smollm2-135m-instruct"
FIELDS = 20
SCHEMA = {"type": "object", "required": [f"field_{i}" for i in range(FIELDS)], "properties": {
    f"field_{i}": [{"type": "string", "maxLength": 12}, {"type": "integer", "minimum": 0, "maximum": 9999},
                   {"enum": ["red", "green", "blue"]}, {"type": "boolean"}][i % 4] for i in range(FIELDS)}}
PROMPT = "Fill in a record with twenty fields."
FREE_PROMPT = "Write a long story about a lighthouse keeper and the sea."


def compile_figures(tok: Tokenizer) -> dict[str, float]:
    t = time.perf_counter()
    gt = grammar_tokenizer(tok)
    tokenizer_ms = (time.perf_counter() - t) * 1e3
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        grammar = json_schema_grammar(SCHEMA)
        gt.check(grammar)
        runs.append((time.perf_counter() - t) * 1e3)
    t = time.perf_counter()
    matcher = Matcher(gt, Constraint(grammar))
    matcher_ms = (time.perf_counter() - t) * 1e3
    rng, mask_us, apply_us = np.random.default_rng(0), [], []
    for _ in range(200):
        logits = rng.standard_normal(tok.vocab_size).astype(np.float32)
        logits[sorted(tok.eos_token_ids)] += 4
        t = time.perf_counter()
        matcher.mask()
        mask_us.append((time.perf_counter() - t) * 1e6)
        t = time.perf_counter()
        token = int(np.argmax(matcher.apply(logits)))
        apply_us.append((time.perf_counter() - t) * 1e6)
        matcher.advance(token)
        if matcher.stopped:
            matcher = Matcher(gt, Constraint(grammar))
    return {"llguidance_tokenizer_ms": tokenizer_ms, "compile_check_20_fields_ms": statistics.median(runs),
            "matcher_ms": matcher_ms, "mask_us_median": statistics.median(mask_us),
            "apply_us_median": statistics.median(apply_us)}


def stream(api: str, constrained: bool, seed: int) -> tuple[float, float, int]:
    """(time to first content, decode tok/s, completion tokens) of one greedy chat stream."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT if constrained else FREE_PROMPT}],
            "max_tokens": 200, "temperature": 0, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    req = urllib.request.Request(f"{api}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start, stamps, tokens = time.perf_counter(), [], 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    return stamps[0] - start, (tokens - 1) / (stamps[-1] - stamps[0]), tokens


def live_figures(engine: str | None, streams: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with Cluster(resolve_model("smollm2")[0], 1, model_id=MODEL, engine=engine) as c:
        api = c.nodes[0].api_url
        stream(api, True, 0)  # warm-up: the node builds its llguidance tokenizer once
        stream(api, False, 0)
        for kind, constrained in (("constrained", True), ("free", False)):
            alone = [stream(api, constrained, s) for s in range(3)]
            out[f"{kind}_ttft_ms"] = statistics.median(a[0] for a in alone) * 1e3
            out[f"{kind}_tok_s_alone"] = statistics.median(a[1] for a in alone)
            out[f"{kind}_tokens"] = statistics.median(a[2] for a in alone)
            with ThreadPoolExecutor(streams) as pool:
                runs = list(pool.map(stream, [api] * streams, [constrained] * streams, range(streams)))
            out[f"{kind}_tok_s_per_stream_x{streams}"] = statistics.median(r[1] for r in runs)
    out["ratio_alone"] = out["constrained_tok_s_alone"] / out["free_tok_s_alone"]
    many = f"tok_s_per_stream_x{streams}"
    out[f"ratio_x{streams}"] = out[f"constrained_{many}"] / out[f"free_{many}"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default=None, help="the node's engine (default: its own default)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--no-live", action="store_true", help="only the entry-side figures")
    args = ap.parse_args()
    figures = compile_figures(Tokenizer.load(resolve_model("smollm2")[0]))
    if not args.no_live:
        figures |= live_figures(args.engine, args.streams)
    for key, value in figures.items():
        print(f"{key:40s} {value:10.2f}")


if __name__ == "__main__":
    main()
