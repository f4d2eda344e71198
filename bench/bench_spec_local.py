"""Speculative decoding in one process on the packaged SmolLM2: tok/s, acceptance and tokens per trip with prompt
lookup and with a draft model, against plain decoding; and the cost of the pure pieces (a lookup at long contexts,
a verification). The 3-node figures through the pipeline are bench/bench_speculative.py's.

    uv run python -m bench.bench_spec_local [--tokens 96] [--target-quantize f16] [--draft-quantize none]

Target: SmolLM2 on the ggml engine as the node runs it by default (F16). Draft model: the same SmolLM2 in the
file's own Q4_1 (`--draft-quantize none`) or requantized (q8_0, q4_0): the same tokenizer, a third of the bytes.
Two prompts: one that repeats its input (rename a variable in ~40 lines of code) and a free chat prompt. Greedy.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from shards.decoding.draft_model import DraftModelProposer
from shards.decoding.sampling import SamplerState, SamplingParams
from shards.decoding.speculation import DraftLength, PromptLookup, verify
from shards.engines.ggml.engine import GgmlEngine
from shards.formats.loader import load_config
from shards.formats.packaged import resolve_model
from shards.formats.tokenizer import Tokenizer
from shards.model.shard import Shard
from shards.reference.generate import generate
from shards.reference.spec_generate import SpeculationStats, speculative_generate

CODE = '''def summarize(items, threshold=0.5):
    """Group the items by kind and report the ones above the threshold."""
    totals = {}
    counts = {}
    for item in items:
        kind = item["kind"]
        totals[kind] = totals.get(kind, 0.0) + item["value"]
        counts[kind] = counts.get(kind, 0) + 1
    report = []
    for kind in sorted(totals):
        mean = totals[kind] / counts[kind]
        if mean > threshold:
            report.append((kind, mean, counts[kind]))
    return report


def largest(items, n=3):
    ranked = sorted(items, key=lambda item: item["value"], reverse=True)
    return ranked[:n]


def by_owner(items):
    owners = {}
    for item in items:
        owners.setdefault(item["owner"], []).append(item)
    return owners


def describe(items):
    lines = []
    for kind, mean, count in summarize(items):
        lines.append(f"{kind}: mean {mean:.2f} over {count} items")
    for item in largest(items):
        lines.append(f"largest: {item['kind']} {item['value']}")
    for owner, owned in sorted(by_owner(items).items()):
        lines.append(f"{owner} owns {len(owned)} items")
    return "\\n".join(lines)
'''
PROMPTS = {
    "rewrite-code": "Rewrite this code with the variable `items` renamed to `records`. Reply with the code only.\n\n"
    + CODE,
    "free-chat": "Tell me about the history of the bicycle and why it became so popular in cities.",
}


def pieces() -> None:
    """The pure pieces' cost: one incremental lookup (one new token, then a proposal) at long contexts, and
    verifying a block of 5 rows of SmolLM2's 49152-token vocabulary."""
    rng = np.random.default_rng(0)
    for context in (1024, 8192, 32768):
        text = rng.integers(0, 49152, context).tolist()
        lookup = PromptLookup()
        lookup.propose("r", text, 4)  # the first call indexes the whole text
        reps, t = 200, time.perf_counter()
        for i in range(reps):
            text.append(int(text[i]))  # a repeat: the lookup finds it
            lookup.propose("r", text, 4)
        print(f"  prompt lookup at {context:>6} tokens: {(time.perf_counter() - t) / reps * 1e6:7.0f} us per token")
    logits = rng.normal(0, 3, size=(5, 49152)).astype(np.float32)
    drafts = tuple(int(x) for x in logits[:4].argmax(axis=1))
    for name, params in (("greedy", SamplingParams(temperature=0.0)), ("t0.8 top-p0.95", SamplingParams(0.8, 0.95))):
        state, reps, t = SamplerState.from_seed(0), 50, time.perf_counter()
        for _ in range(reps):
            verify(logits, drafts, params, state)
        print(f"  verify 4 drafts ({name}): {(time.perf_counter() - t) / reps * 1e3:6.2f} ms per block")


def target_engine(path, quantize: str):
    cfg = load_config(path)
    return GgmlEngine(path, Shard.whole("smollm2", cfg.n_layers), cfg, quantize=quantize)


def run(label: str, gen, n: int, stats: SpeculationStats | None = None) -> list[int]:
    t0 = time.perf_counter()
    tokens, first = [], None
    for r in gen:
        tokens.append(r.token)
        first = first or time.perf_counter()
    end = time.perf_counter()
    rate = (len(tokens) - 1) / (end - first) if len(tokens) > 1 else 0.0
    line = f"  {label:<28} {len(tokens):>4} tokens, first {first - t0:5.2f} s, then {rate:6.1f} tok/s"
    if stats is not None:
        line += (
            f"; {stats.proposed} proposed, {stats.accepted} accepted ({stats.acceptance:.0%}), "
            f"{stats.tokens_per_trip:.2f} tokens/trip"
        )
    print(line, flush=True)
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--max-draft", type=int, default=4)
    ap.add_argument("--target-quantize", default="f16")
    ap.add_argument("--draft-quantize", default="none")
    args = ap.parse_args()
    print(f"load {os.getloadavg()[0]:.1f} (1 min)")
    print("pieces:")
    pieces()
    path, _ = resolve_model("smollm2")
    tok = Tokenizer.load(path)
    target = target_engine(path, args.target_quantize)
    draft = DraftModelProposer.load(
        path, target.config, engine="ggml", target_tokenizer=tok, quantize=args.draft_quantize
    )
    greedy = SamplingParams(temperature=0.0)
    eos = tok.eos_token_ids
    for name, text in PROMPTS.items():
        prompt = tok.encode_chat([{"role": "user", "content": text}])
        print(f"{name} ({len(prompt)} prompt tokens), target {args.target_quantize}:")
        plain = run("plain", generate([target], prompt, args.tokens, greedy, eos), args.tokens)
        for label, proposer in (("prompt lookup", PromptLookup()), (f"draft {args.draft_quantize}", draft)):
            stats = SpeculationStats()
            length = DraftLength(args.max_draft)
            gen = speculative_generate(
                [target], prompt, args.tokens, greedy, proposer=proposer, length=length, eos_ids=eos, stats=stats
            )
            tokens = run(label, gen, args.tokens, stats)
            same = "same text" if tokens == plain else f"differs from token {_first_difference(tokens, plain)}"
            print(f"    ({same} as plain)")
    print(f"load {os.getloadavg()[0]:.1f} (1 min)")


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


if __name__ == "__main__":
    main()
