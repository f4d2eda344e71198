"""The official openai client, unmodified, against a live single node and a live 3-node cluster."""

import asyncio

import openai
import pytest


@pytest.fixture(params=["single_api", "cluster_api"])
def api(request):
    """(base url, api key) of a live entry node: a single node, or the entry of a 3-node cluster."""
    return request.getfixturevalue(request.param)


@pytest.fixture
def client(api):
    url, key = api
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def chat(client, content="The capital of France is", **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="llama", messages=[{"role": "user", "content": content}], **kw)


def test_non_streaming_chat_completion(client):
    r = chat(client, max_tokens=12)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "llama"
    assert r.created > 1_700_000_000
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.completion_tokens, r.usage.total_tokens) == (12, r.usage.prompt_tokens + 12)


def test_streaming_chat_equals_non_streaming_and_reports_usage(client):
    whole = chat(client, max_tokens=16).choices[0].message.content
    chunks = list(chat(client, max_tokens=16, stream=True, stream_options={"include_usage": True}))
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    final, usage = chunks[-2], chunks[-1]
    assert final.choices[0].finish_reason == "length" and not final.choices[0].delta.content
    assert usage.choices == [] and usage.usage.completion_tokens == 16


def test_without_include_usage_no_usage_chunk(client):
    chunks = list(chat(client, max_tokens=4, stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_async_client_streaming_and_not(api):
    url, key = api

    async def go():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as aclient:
            msgs = [{"role": "user", "content": "Hello"}]
            whole = await aclient.chat.completions.create(model="llama", messages=msgs, max_tokens=10, temperature=0)
            stream = await aclient.chat.completions.create(
                model="llama", messages=msgs, max_tokens=10, temperature=0, stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            return whole.choices[0].message.content, text

    whole, streamed = asyncio.run(go())
    assert whole == streamed and whole


def test_stop_sequences_cut_the_text_even_across_tokens(client):
    greedy = chat(client, max_tokens=30)
    text = greedy.choices[0].message.content
    stop = text[6:11]  # five characters from the middle: spans a token boundary in this model
    assert stop not in text[:6]
    for stream in (False, True):
        if stream:
            chunks = list(chat(client, max_tokens=30, stop=[stop, "never-appears"], stream=True))
            out = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            r = chat(client, max_tokens=30, stop=stop)
            out, reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert (out, reason) == (text[:6], "stop")


def test_logprobs(client):
    r = chat(client, max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the most likely
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    assert chat(client, max_tokens=2).choices[0].logprobs is None


def test_seed_makes_sampling_reproducible(client):
    a = chat(client, max_tokens=20, temperature=1.0, seed=42).choices[0].message.content
    b = chat(client, max_tokens=20, temperature=1.0, seed=42).choices[0].message.content
    c = chat(client, max_tokens=20, temperature=1.0, seed=43).choices[0].message.content
    assert a == b and a != c


def test_legacy_completions(client):
    r = client.completions.create(
        model="llama", prompt="The capital of", max_tokens=8, temperature=0, logprobs=2, echo=True
    )
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text.startswith("The capital of") and r.choices[0].finish_reason == "length"
    assert len(r.choices[0].logprobs.tokens) == 8 and r.usage.completion_tokens == 8
    streamed = client.completions.create(
        model="llama", prompt="The capital of", max_tokens=8, temperature=0, stream=True
    )
    assert "The capital of" + "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    ids = client.completions.create(model="llama", prompt=[290, 345, 284], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3


def test_models_endpoints(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["llama"] and models.data[0].object == "model"
    assert client.models.retrieve("llama").owned_by == "exo-node"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_errors_are_the_clients_exception_types(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, temperature=3.5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=10_000)
    assert e.value.body["code"] == "context_length_exceeded"


def test_wrong_api_key_is_an_authentication_error(single_api):
    bad = openai.OpenAI(base_url=f"{single_api[0]}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        chat(bad, max_tokens=1)
