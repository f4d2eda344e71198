"""Speculative decoding's speed: one greedy stream through 3 loopback nodes with prompt lookup vs without, on a task
that repeats its input (rewrite ~40 lines of code with a variable renamed) and on a free chat prompt; one node
without speculation for reference; optionally a draft model (`--draft PATH`) on 1 and 3 nodes.

    uv run --group bench python -m bench.bench_speculative [--tokens 200] [--repeats 2] [--model smollm2 | PATH]
        [--node-args "--threads 1"] [--draft PATH] [--json out.json]

Decode speed is completion tokens after the first over the time from the first to the last streamed piece (prefill
excluded); "accepted" is the last node's accepted/proposed counts over the run; "same text" compares each run's
answer with one node's without speculation (on F16 weights, SmolLM2's default, ggml's rows are not bit-identical
however a step batches them, so a near-tie may go the other way). Without speculation a request is
sent with `"speculative": false`, which makes no proposals at all (the same as `--speculate off`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import time
import urllib.request
from dataclasses import asdict, dataclass

from bench.local_cluster import Cluster
from shards.formats.packaged import resolve_model

CODE = """import json
from dataclasses import dataclass


@dataclass
class Order:
    order_id: str
    customer: str
    items: list
    shipped: bool = False


def load_orders(path):
    with open(path) as f:
        records = json.load(f)
    orders = []
    for record in records:
        orders.append(Order(record["id"], record["customer"], record["items"], record.get("shipped", False)))
    return orders


def order_total(order, prices):
    total = 0.0
    for item in order.items:
        total += prices[item["sku"]] * item["quantity"]
    return round(total, 2)


def pending_orders(orders):
    return [order for order in orders if not order.shipped]


def totals_by_customer(orders, prices):
    totals = {}
    for order in orders:
        totals[order.customer] = totals.get(order.customer, 0.0) + order_total(order, prices)
    return totals


def mark_shipped(orders, order_id):
    for order in orders:
        if order.order_id == order_id:
            order.shipped = True
            return order
    raise KeyError(order_id)
"""
PROMPTS = {
    "rewrite": f"Rewrite this code with the variable `order` renamed to `purchase`. Answer with the code only.\n\n{CODE}",
    "chat": "Write a short story about a cat who learns to sail, with a twist at the end.",
}


@dataclass
class Run:
    setup: str
    prompt: str
    speculative: bool
    tok_s: float
    tokens: int
    proposed: int
    accepted: int
    text: str


def stream(api_url: str, model: str, prompt: str, tokens: int, speculative: bool) -> tuple[int, float, str]:
    """(completion tokens, seconds from the first streamed piece to the last, text) of one greedy stream."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculative": speculative,
    }
    req = urllib.request.Request(
        f"{api_url}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    first = last = None
    used, text = 0, ""
    with urllib.request.urlopen(req, timeout=1200) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                used = event["usage"]["completion_tokens"]
            piece = "".join(c.get("delta", {}).get("content") or "" for c in event.get("choices", []))
            if piece:
                last = time.perf_counter()
                first = first or last
                text += piece
    return used, (last - first) if first and last else 0.0, text


def counts(c: Cluster) -> tuple[int, int]:
    status = c.self_info()[c.nodes[-1].node_id]["status"]
    return status.get("spec_proposed", 0), status.get("spec_accepted", 0)


def measure(c: Cluster, setup: str, model: str, args, modes: tuple[bool, ...]) -> list[Run]:
    runs = []
    stream(c.nodes[0].api_url, model, "Hello", 8, False)  # warm-up: engines loaded, graphs built
    for name, prompt in PROMPTS.items():
        for speculative in modes:
            rates, n, text = [], 0, ""
            p0, a0 = counts(c)
            for _ in range(args.repeats):
                n, seconds, text = stream(c.nodes[0].api_url, model, prompt, args.tokens, speculative)
                rates.append((n - 1) / seconds if seconds else 0.0)
            p1, a1 = counts(c)
            run = Run(setup, name, speculative, statistics.median(rates), n, p1 - p0, a1 - a0, text)
            print(json.dumps({k: v for k, v in asdict(run).items() if k != "text"}), flush=True)
            runs.append(run)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--node-args", default="", help="more flags for every node, e.g. '--threads 1'")
    ap.add_argument("--draft", help="a draft model (GGUF or folder with the same tokenizer): measured too")
    ap.add_argument("--json", help="write the runs here")
    args = ap.parse_args()
    path, model = resolve_model(args.model)
    extra = shlex.split(args.node_args)
    print(f"load before: {os.getloadavg()}", flush=True)
    runs: list[Run] = []
    setups = [("3 nodes, prompt lookup", 3, [], (True, False)), ("1 node", 1, [], (False, True))]
    if args.draft:
        draft = ["--speculate", "draft", "--draft-model", args.draft]
        setups += [("3 nodes, draft model", 3, draft, (True,)), ("1 node, draft model", 1, draft, (True,))]
    for setup, n, flags, modes in setups:
        memory = [2.0] * n
        with Cluster(path, n, memory_gb=memory, model_id=model, engine=None, extra=extra + flags) as c:
            runs += measure(c, setup, model, args, modes)
    print(f"load after: {os.getloadavg()}", flush=True)
    base = {r.prompt: r for r in runs if r.setup == "1 node" and not r.speculative}
    print(f"\n{'setup':28} {'prompt':8} {'spec':5} {'tok/s':>7} {'vs 1 node':>9} {'accepted':>12} same text")
    for r in runs:
        share = f"{r.accepted}/{r.proposed}" if r.proposed else "-"
        print(
            f"{r.setup:28} {r.prompt:8} {'on' if r.speculative else 'off':5} {r.tok_s:7.1f} "
            f"{r.tok_s / base[r.prompt].tok_s:8.2f}x {share:>12} {r.text == base[r.prompt].text}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in runs], f, indent=1)


if __name__ == "__main__":
    main()
