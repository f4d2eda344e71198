"""Prompts are tokenized off the event loop, and only when they might fit: a megabyte of text must not hold the
loop (and with it gRPC and health checks) for seconds."""

import asyncio
import random
import string
import time

import pytest

from node.http import prompt
from node.http.prompt import PromptEncoder
from node.http.schema import ApiError
from node.runtime.loop_monitor import LoopMonitor
from shards.formats.packaged import DEFAULT_MODEL, resolve_model
from shards.formats.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.load(resolve_model(DEFAULT_MODEL)[0])  # SmolLM2's: a real vocabulary of 49152 tokens


def words(n_chars: int) -> str:
    rng = random.Random(0)
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(2000)]
    return " ".join(rng.choice(vocab) for _ in range(n_chars // 5))[:n_chars]


def test_a_text_longer_than_the_context_could_hold_is_refused_without_tokenizing(tokenizer, monkeypatch):
    encoder = PromptEncoder(tokenizer, context=8192)
    calls = []
    monkeypatch.setattr(prompt, "encode_releasing_the_gil", lambda *a: calls.append(a) or [])
    with pytest.raises(ApiError) as e:
        asyncio.run(encoder.text("x" * (encoder.max_chars + 1)))
    assert (e.value.status, e.value.code) == (400, "context_length_exceeded") and not calls


def test_the_bound_never_refuses_a_text_that_fits(tokenizer):
    """Even a text of the longest token repeated: n characters are at least n / max_token_chars tokens."""
    longest = max(tokenizer.hf.get_vocab(), key=len)
    text = tokenizer.hf.decode([tokenizer.hf.token_to_id(longest)]) * 4
    encoder = PromptEncoder(tokenizer, context=len(tokenizer.encode(text, add_special_tokens=False)))
    assert asyncio.run(encoder.text(text)) == tokenizer.encode(text)


def test_tokenizing_a_long_prompt_leaves_the_event_loop_free(tokenizer):
    encoder = PromptEncoder(tokenizer, context=8192)
    text = words(encoder.max_chars // 4)  # ~165 KB: seconds of tokenizing on a slow machine
    lags = []

    async def go():
        monitor = asyncio.ensure_future(LoopMonitor(lags.append, interval=0.01).run())
        started = time.perf_counter()
        ids = await asyncio.gather(encoder.text(text), encoder.text(text))
        took = time.perf_counter() - started
        monitor.cancel()
        return ids, took

    (first, second), took = asyncio.run(go())
    assert first == second == tokenizer.encode(text)
    # The loop woke on time all along (held at most for a fraction of the tokenizing, not for all of it).
    assert max(lags) < took / 4, f"the loop was held {max(lags):.2f}s of {took:.2f}s of tokenizing"


def test_a_chat_is_tokenized_as_the_tokenizer_would(tokenizer):
    messages = [{"role": "user", "content": words(2000)}]
    assert asyncio.run(PromptEncoder(tokenizer, 8192).chat(messages)) == tokenizer.encode_chat(messages)
