"""Many clients, one system prompt: what the retained caches hold, and how fast each conversation's next turn starts.

    uv run python -m bench.bench_prefix_clients [--clients 8] [--system-words 240] [--nodes 1] [--out FILE]

One exo node (or a ring of `--nodes`, the packaged SmolLM2 split evenly) with its default settings. Each of N clients
sends the same long system prompt and a question of its own (turn 1, one client after another), then every client
sends its second turn, interleaved with a one-off question from a stranger between each two (the stranger shares
only the chat template's preamble). Reported, from the entry's and the nodes' Prometheus metrics: the retained
caches' memory after the first turns and at the end (summed over nodes), how many are held as branches, the prompt
positions each second turn did not compute again, and the median time to the first token of the second turns
(streamed), beside that of the first turns.

Run it from two trees (this one and an older one, the same file copied) to compare what sharing saves: the file
needs nothing newer than `bench/local_cluster.py` and the metrics every node exports.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.local_cluster import Cluster
from shards.formats.packaged import resolve_model

WORDS = (
    "policy refund warranty shipping order invoice customer support ticket priority weekend holiday store "
    "account password delivery address tracking return exchange damaged item receipt payment card voucher"
).split()


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def ask(url: str, model: str, messages: list[dict]) -> tuple[float, str]:
    """Time to the first streamed token, and the whole answer (greedy, 24 tokens)."""
    body = {"model": model, "messages": messages, "max_tokens": 24, "temperature": 0, "stream": True}
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start, first, text = time.perf_counter(), None, []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content")
            if delta:
                first = first or time.perf_counter() - start
                text.append(delta)
    return first or time.perf_counter() - start, "".join(text)


def run(clients: int, system_words: int, nodes: int) -> dict:
    model, model_id = resolve_model("smollm2")
    shards = None if nodes == 1 else [f"{30 * i // nodes}:{30 * (i + 1) // nodes}" for i in range(nodes)]
    system = {"role": "system", "content": " ".join(WORDS[i % len(WORDS)] for i in range(system_words)) + "."}
    with Cluster(model, nodes, shards=shards, model_id=model_id, engine=None) as c:
        entry = c.nodes[0].api_url  # every node serves the API (and its metrics); clients use the first

        def held(name: str) -> float:
            return sum(metric(n.api_url, name) for n in c.nodes)

        conversations, first_ttft = [], []
        for i in range(clients):
            messages = [system, {"role": "user", "content": f"Client {i} asks: what about item number {i * 7}?"}]
            ttft, answer = ask(entry, model_id, messages)
            first_ttft.append(ttft)
            conversations.append(messages + [{"role": "assistant", "content": answer}])
        time.sleep(1)  # the ends reach every node
        after_first = {"bytes": held("exo_kv_retained_bytes"), "branches": held("exo_kv_retained_branches")}
        second_ttft, hits = [], []
        for i, messages in enumerate(conversations):
            ask(entry, model_id, [{"role": "user", "content": f"Stranger {i}: is the shop open today?"}])
            messages.append({"role": "user", "content": "Thanks. And can I pay by card?"})
            before = metric(entry, "exo_prefix_hit_tokens_total")
            second_ttft.append(ask(entry, model_id, messages)[0])
            hits.append(metric(entry, "exo_prefix_hit_tokens_total") - before)
        time.sleep(1)
        return {
            "clients": clients,
            "system_words": system_words,
            "nodes": nodes,
            "retained_after_first_turns_mb": after_first["bytes"] / 2**20,
            "branches_after_first_turns": after_first["branches"],
            "retained_at_end_mb": held("exo_kv_retained_bytes") / 2**20,
            "branches_at_end": held("exo_kv_retained_branches"),
            "second_turn_hit_tokens_median": statistics.median(hits),
            "first_turn_ttft_ms_median": 1000 * statistics.median(first_ttft),
            "second_turn_ttft_ms_median": 1000 * statistics.median(second_ttft),
            "load": os.getloadavg()[0],
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--system-words", type=int, default=240)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    result = run(a.clients, a.system_words, a.nodes)
    print(json.dumps(result, indent=1))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
