"""Speculative decoding on three real nodes (SmolLM2 on ggml, its file's Q4_1 blocks, `--quantize none`: rows are
bit-identical however a step batches them): two concurrent requests, one greedy code rewrite that repeats its
input and one seeded sampled story, give with prompt lookup (the default) the text they give with
`"speculative": false`, and the proposals were accepted, several tokens a trip (also in /metrics)."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.cluster import Cluster
from tests.support.http import call_json, stream_completion
from tests.support.metrics import scrape, value

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.formats.packaged import DEFAULT_MODEL, resolve_model  # noqa: E402
from shards.formats.tokenizer import Tokenizer  # noqa: E402

CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
"""
REWRITE = f"Rewrite this code with the variable `items` renamed to `products`:\n\n{CODE}"
STORY = "Tell me a short story about a lighthouse."


@pytest.fixture(scope="module")
def cluster():
    """One cluster for the module (counters are read as differences): the last test kills its node2."""
    path, model_id = resolve_model(DEFAULT_MODEL)
    extra = ["--threads", "1", "--quantize", "none"]
    with Cluster(path, 3, memory_gb=[2, 2, 2], model_id=model_id, engine=None, extra=extra) as c:
        yield c


def counts(c: Cluster, name: str) -> dict[str, int]:
    return {node_id: info["status"].get(name, 0) for node_id, info in c.self_info().items()}


def test_three_nodes_give_the_same_text_with_and_without_speculation_for_concurrent_requests(cluster):
    c, model_id = cluster, cluster.model_id
    url = f"{c.nodes[0].api_url}/v1/chat/completions"

    def ask(prompt: str, speculative: bool, **sampling) -> str:
        body = {
            "model": model_id,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 40,
            "speculative": speculative,
            **sampling,
        }
        status, answer = call_json("POST", url, body, timeout=180)
        assert status == 200, answer
        return answer["choices"][0]["message"]["content"]

    jobs = [(REWRITE, {"temperature": 0}), (STORY, {"temperature": 0.8, "seed": 5})]
    with ThreadPoolExecutor(2) as pool:
        proposed = counts(c, "spec_proposed")
        plain = list(pool.map(lambda job: ask(job[0], False, **job[1]), jobs))
        assert counts(c, "spec_proposed") == proposed  # opted out: not one proposal
        fast = list(pool.map(lambda job: ask(job[0], True, **job[1]), jobs))
    assert fast == plain
    last = c.self_info()["node2"]["status"]
    assert last["spec_accepted"] > 0
    assert sum(v for k, v in last.items() if k.startswith("tokens_per_trip_") and k != "tokens_per_trip_1") > 0
    samples = scrape(c.nodes[2].api_url)  # the same counts, as Prometheus reads them
    assert value(samples, "exo_speculative_accepted_total") == last["spec_accepted"]
    assert value(samples, "exo_speculative_proposed_total") == last["spec_proposed"]
    assert value(samples, "exo_tokens_per_trip_sum") > value(samples, "exo_tokens_per_trip_count") > 0
    assert set(c.wait_idle().values()) == {0}


def test_a_speculating_stream_whose_last_node_is_killed_is_replayed_with_the_same_text(cluster):
    """Replay stays exact with proposals in flight: the new plan prefills prompt + generated tokens and verifies
    with the same rule (greedy here; seeded streams: tests/cluster/test_replay_ggml.py, speculation on too).
    (The module's last test: it kills node2.)"""
    c = cluster
    # the chat's prompt as token ids: the instruct answer rewrites the code, repeating it, on every CPU tried (as a
    # raw text prompt the continuation depends on the CPU's kernels, and on one it left prompt lookup nothing to hit)
    ids = Tokenizer.load(resolve_model(DEFAULT_MODEL)[0]).encode_chat([{"role": "user", "content": REWRITE}])
    body = {"model": c.model_id, "prompt": [int(i) for i in ids], "max_tokens": 48, "temperature": 0}
    url = f"{c.nodes[0].api_url}/v1/completions"
    reference = "".join(e.text for e in stream_completion(url, body, timeout=180))
    accepted = counts(c, "spec_accepted")  # (the module's earlier requests counted too)
    events = []
    for event in stream_completion(url, body, timeout=180):
        events.append(event)
        if len(events) == 6:
            c.nodes[2].proc.kill()
    assert [e.error for e in events if e.error] == [] and "".join(e.text for e in events) == reference
    assert c.self_info()["node0"]["status"]["replays"] == 1
    after = counts(c, "spec_accepted")  # the survivors'
    assert sum(n - accepted[node_id] for node_id, n in after.items()) > 0  # it speculated after
