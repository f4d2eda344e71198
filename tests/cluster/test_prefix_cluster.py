"""Prefix reuse through live nodes: every turn of a chat resends the conversation, the entry finds the prefix
every node of the plan retained and sends only the rest, and each answer is the one-process reference's; a node
that had to evict the prefix says so and the entry prefills everything, with the same answer."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.local_cluster import http
from shards.engines.numpy_engine import NumpyEngine
from shards.formats.config import ModelConfig
from shards.formats.tokenizer import Tokenizer
from shards.model.shard import Shard
from shards.reference.generate import generate
from tests.support.cluster import Cluster
from tests.support.metrics import scrape, value
from tests.support.models import FIXTURES
from tests.support.polling import wait_until

MODEL = FIXTURES / "llama"
TURNS = ["Hello there, how are you?", "Tell me more about it.", "Why?"]


def reference(messages: list[dict], max_tokens: int) -> str:
    cfg, tok = ModelConfig.from_dir(MODEL), Tokenizer(MODEL)
    engine = NumpyEngine(MODEL, Shard.whole("llama", cfg.n_layers), cfg)
    return tok.decode(
        [r.token for r in generate([engine], tok.encode_chat(messages), max_tokens, eos_ids=tok.eos_token_ids)]
    )


def chat(c: Cluster, turns: int = len(TURNS)) -> list[str]:
    messages, answers = [], []
    for text in TURNS[:turns]:
        messages.append({"role": "user", "content": text})
        status, body = c.chat(messages, max_tokens=10, temperature=0)
        assert status == 200, body
        answer = body["choices"][0]["message"]["content"]
        assert answer == reference(messages, 10)
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer})
    return answers


@pytest.fixture(scope="module", params=[None, ["0:2", "2:4", "4:6"]], ids=["1 node", "3 nodes"])
def ring(request):
    """One cluster per ring shape for the tests that read its counters as differences."""
    shards = request.param
    with Cluster(MODEL, 1 if shards is None else 3, shards=shards) as c:
        yield c


def counters(c: Cluster) -> dict:
    return dict(c.self_info()["node0"]["status"])


def test_each_turn_of_a_chat_reuses_the_conversation_so_far_and_answers_as_one_process(ring):
    before = counters(ring)
    chat(ring)
    status = counters(ring)
    assert status["prefix_hits"] - before.get("prefix_hits", 0) == len(TURNS) - 1
    assert status["prefix_hit_tokens"] - before.get("prefix_hit_tokens", 0) > 20
    assert status.get("prefix_fallbacks", 0) == 0
    assert value(scrape(ring.nodes[0].api_url), "exo_prefix_hit_tokens_total") == status["prefix_hit_tokens"]


def test_a_conversation_keeps_its_cache_while_other_clients_come_between_its_turns(ring):
    """Two conversations and a one-off question interleaved: each request shares the template's preamble with
    every retained cache, yet each conversation's next turn resumes from all of its own history."""
    a, b = [{"role": "user", "content": TURNS[0]}], [{"role": "user", "content": "What is the weather like?"}]
    for messages in (a, b):
        status, body = ring.chat(messages, max_tokens=10, temperature=0)
        assert status == 200, body
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    hit_tokens = []
    for messages, follow_up in ((a, TURNS[1]), ([{"role": "user", "content": "Say hi."}], None), (b, "And why?")):
        if follow_up is not None:
            messages.append({"role": "user", "content": follow_up})
        before = counters(ring).get("prefix_hit_tokens", 0)
        status, body = ring.chat(messages, max_tokens=10, temperature=0)
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == reference(messages, 10)
        hit_tokens.append(counters(ring)["prefix_hit_tokens"] - before)
    conversation_a, one_off, conversation_b = hit_tokens
    # each conversation's turn 2 reuses its whole first turn (prompt and answer), not just the shared preamble
    assert conversation_a > one_off + 10 and conversation_b > one_off + 10
    assert counters(ring).get("prefix_fallbacks", 0) == 0


def node_prefix(c: Cluster, key: str) -> list[int]:
    return [info["status"].get(key, 0) for info in c.self_info().values()]


def test_clients_sharing_a_system_prompt_hold_it_once_on_every_node(ring):
    """Three clients with one long system prompt, one after another: the second and third are held on every node of
    the plan only past the blocks they share with the first (branches), so they add less memory than the first
    did; each answer is the one-process reference's, and a branch's next turn resumes from all of its history."""
    system = {"role": "system", "content": "You are a careful assistant for a small hardware shop. " * 3}
    questions = ["Do you sell cables?", "When do you open tomorrow?", "Can I return a used fan?"]
    branches, held = node_prefix(ring, "retained_branches"), node_prefix(ring, "retained_bytes")
    added, conversations = [], []
    for i, question in enumerate(questions):
        messages = [system, {"role": "user", "content": question}]
        status, body = ring.chat(messages, max_tokens=10, temperature=0)
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == reference(messages, 10)
        conversations.append(messages + [{"role": "assistant", "content": body["choices"][0]["message"]["content"]}])
        wait_until(
            lambda: all(n - b >= i for n, b in zip(node_prefix(ring, "retained_branches"), branches)),
            10,
            "every node to hold the request as a branch",
        )
        now = node_prefix(ring, "retained_bytes")
        added.append([n - h for n, h in zip(now, held)])
        held = now
    first, second, third = added
    assert all(b + c < a for a, b, c in zip(first, second, third)), added

    messages = conversations[1] + [{"role": "user", "content": "And on Sunday?"}]
    before = counters(ring).get("prefix_hit_tokens", 0)
    status, body = ring.chat(messages, max_tokens=10, temperature=0)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == reference(messages, 10)
    assert counters(ring)["prefix_hit_tokens"] - before > 60  # the system prompt, the question and the answer
    assert counters(ring).get("prefix_fallbacks", 0) == 0


def test_concurrent_clients_sharing_a_system_prompt_each_get_the_one_process_answer(ring):
    """Six clients at once, three turns each, one system prompt: prefixes are retained, branched and resumed while
    other requests run on every node, and every answer is still the reference's."""
    system = {"role": "system", "content": "You answer for a bicycle repair shop, briefly and politely. " * 3}
    before, branches = counters(ring), node_prefix(ring, "retained_branches")

    def client(i: int) -> list[tuple[list[dict], str]]:
        messages, said = [system, {"role": "user", "content": f"Question {i}: can you fix wheel {i * 13}?"}], []
        for _ in range(3):
            status, body = ring.chat(messages, max_tokens=8, temperature=0)
            assert status == 200, body
            said.append((list(messages), body["choices"][0]["message"]["content"]))
            messages = messages + [{"role": "assistant", "content": said[-1][1]}, {"role": "user", "content": "Why?"}]
        return said

    with ThreadPoolExecutor(6) as pool:
        conversations = list(pool.map(client, range(6)))
    for messages, answer in (turn for said in conversations for turn in said):
        assert answer == reference(messages, 8)
    after = counters(ring)
    assert after["prefix_hits"] - before.get("prefix_hits", 0) >= 12  # every later turn, at least
    assert after.get("prefix_fallbacks", 0) == before.get("prefix_fallbacks", 0)
    assert all(n > b for n, b in zip(node_prefix(ring, "retained_branches"), branches))


def test_a_node_that_evicted_the_prefix_makes_the_entry_prefill_everything():
    # KV memory for the second turn's reservation but not also the first turn's retained cache (1536 bytes a
    # position here): admitting the second turn leaves the retained cache no room, and it is evicted
    with Cluster(MODEL, 1, extra=["--kv-memory-gb", "0.00012"]) as c:
        chat(c, turns=2)
        status = c.self_info()["node0"]["status"]
        assert status["prefix_hits"] == 1 and status["prefix_gone"] == 1 and status["prefix_fallbacks"] == 1
        metrics = scrape(c.nodes[0].api_url)
        assert value(metrics, "exo_prefix_evictions_total") == 1 and value(metrics, "exo_prefix_fallbacks_total") == 1


def test_with_prefix_cache_per_key_a_client_reuses_only_its_own_prefixes():
    """--prefix-cache per-key: the same conversation sent with another API key prefills everything (no timing tells
    it what the first client asked), and the first client's next turn still resumes from all of its history."""
    with Cluster(MODEL, 1, extra=["--prefix-cache", "per-key"]) as c:
        url = f"{c.nodes[0].api_url}/v1/chat/completions"
        messages = [{"role": "user", "content": TURNS[0]}]

        def ask(key: str) -> int:
            before = counters(c).get("prefix_hit_tokens", 0)
            status, body = http(
                "POST", url, {"model": c.model_id, "messages": messages, "max_tokens": 10, "temperature": 0}, key=key
            )
            assert status == 200, body
            assert body["choices"][0]["message"]["content"] == reference(messages, 10)
            return counters(c).get("prefix_hit_tokens", 0) - before

        ask("alice")
        messages += [{"role": "assistant", "content": reference(messages, 10)}, {"role": "user", "content": TURNS[1]}]
        assert ask("bob") == 0  # alice's cache, and even the template's preamble, are not bob's
        assert ask("alice") > 20
