"""Grammar-constrained sampling: what a JSON schema costs.

    uv run python -m bench.bench_grammar [--engine ggml] [--streams 8]

1. On the entry: time to compile and check a 20-field schema against SmolLM2's vocabulary (shards/decoding/grammar.py),
   and to build a request's matcher; per token, a mask (computed on the grammar thread) and its application.
2. On a live single node serving the packaged SmolLM2: decode tok/s of a constrained stream vs an unconstrained
   one, alone and with `--streams` concurrent streams of the same kind, and the time to first token of a request
   carrying the 20-field schema (its grammar compiled at the entry) vs one without.
Decode tok/s = (completion tokens - 1) / (last chunk - first chunk), from the stream's usage chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.local_cluster import ROOT, Cluster
from node.runtime.sampling_batcher import SampleItem, SamplingBatcher
from shards.decoding.grammar import Constraint, Matcher, grammar_tokenizer, json_schema_grammar
from shards.decoding.sampling import SamplerState, SamplingParams
from shards.engines.numpy_engine import NumpyEngine
from shards.formats.packaged import resolve_model
from shards.formats.tokenizer import Tokenizer
from shards.model.shard import Shard

MODEL = "smollm2-135m-instruct"
FIELDS = 20
SCHEMA = {
    "type": "object",
    "required": [f"field_{i}" for i in range(FIELDS)],
    "properties": {
        f"field_{i}": [
            {"type": "string", "maxLength": 12},
            {"type": "integer", "minimum": 0, "maximum": 9999},
            {"enum": ["red", "green", "blue"]},
            {"type": "boolean"},
        ][i % 4]
        for i in range(FIELDS)
    },
}
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
    return {
        "llguidance_tokenizer_ms": tokenizer_ms,
        "compile_check_20_fields_ms": statistics.median(runs),
        "matcher_ms": matcher_ms,
        "mask_us_median": statistics.median(mask_us),
        "apply_us_median": statistics.median(apply_us),
    }


def batcher_figures(tok: Tokenizer, rows: int = 8, steps: int = 60) -> dict[str, float]:
    """ms per sampling step of `rows` rows at SmolLM2's vocabulary through the batcher, all constrained vs all free.
    No forward pass runs between steps here, so the next masks can't overlap one: the constrained figure is the
    worst case (in a node they are computed while the forward pass runs)."""
    engine = NumpyEngine(ROOT / "tests" / "fixtures" / "llama", Shard("llama", 5, 6, 6))  # only its sampler is used
    gt = grammar_tokenizer(tok)
    grammar = Constraint(json_schema_grammar(SCHEMA))
    logits = np.random.default_rng(0).normal(0, 2, (steps, rows, tok.vocab_size)).astype(np.float32)

    async def run(constrained: bool) -> float:
        batcher = SamplingBatcher(rows, 5.0, grammar=lambda: gt)
        params = SamplingParams(temperature=0.8, seed=1, constraint=grammar if constrained else None)
        states = [SamplerState.from_seed(i) for i in range(rows)]
        took = []
        for step in range(steps):
            for st in states:
                if st.matcher is not None and st.matcher.stopped:
                    st.matcher = None  # the record is complete: start another
            t = time.perf_counter()
            futures = [
                batcher.submit(SampleItem(f"r{i}", logits[step, i], params, states[i], engine, "m"))
                for i in range(rows)
            ]
            batcher.flush()
            await asyncio.gather(*futures)
            took.append(time.perf_counter() - t)
        await batcher.close()
        return statistics.median(took[5:]) * 1e3

    return {
        f"batcher_step_ms_{rows}_free": asyncio.run(run(False)),
        f"batcher_step_ms_{rows}_constrained": asyncio.run(run(True)),
    }


def stream(api: str, constrained: bool, seed: int) -> tuple[float, float, int]:
    """(time to first content, decode tok/s, completion tokens) of one greedy chat stream."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT if constrained else FREE_PROMPT}],
        "max_tokens": 200,
        "temperature": 0,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    req = urllib.request.Request(
        f"{api}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
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
    tok = Tokenizer.load(resolve_model("smollm2")[0])
    figures = compile_figures(tok) | batcher_figures(tok)
    if not args.no_live:
        figures |= live_figures(args.engine, args.streams)
    for key, value in figures.items():
        print(f"{key:40s} {value:10.2f}")


if __name__ == "__main__":
    main()
