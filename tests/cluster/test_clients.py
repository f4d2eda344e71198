"""The Ollama, Anthropic Messages and OpenAI Responses APIs through their official clients, unmodified, on the
packaged SmolLM2 (its default engine), on one node and on three: plain, streamed, multi-turn, a two-step tool loop
(the model calls a tool, the client sends the result, the model answers) and structured output.

All three dialects run one chat path (node/http/chat.py), so what the entry alone decides is shown on one node;
on three, each client's plain and streamed answers and one tool call (the grammar constraining the last node,
another process) show the path crosses the ring the same way. Two clusters for the module, shared by every test.
"""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import jsonschema
import ollama
import openai
import pytest
from pydantic import BaseModel, Field

from shards.decoding.grammar import closed_objects
from tests.support.cluster import Cluster
from tests.support.gguf_util import smollm2_path

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]}
DESCRIPTION = "The current weather in a city"
HI = "Give me one tip for learning a language."
ONE_NODE = pytest.mark.parametrize("url", [1], ids=["1-node"], indirect=True)


class City(BaseModel):
    name: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=100)


@pytest.fixture(scope="module", params=[1, 3], ids=["1-node", "3-nodes"])
def url(request):
    shards = ["0:10", "10:20", "20:30"] if request.param == 3 else None
    with Cluster(smollm2_path(), request.param, shards=shards, model_id=MODEL, engine=None) as c:
        yield c.nodes[0].api_url


# -- Ollama -----------------------------------------------------------------------------------------------------
def test_ollama_chat_streamed_is_the_whole_answer_in_pieces(url):
    client = ollama.Client(host=url)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": HI}], options={"num_predict": 16, "temperature": 0})
    whole = client.chat(**kw, stream=False)
    parts = list(client.chat(**kw, stream=True))
    assert whole.done and whole.done_reason in ("stop", "length") and whole.eval_count >= 1
    assert "".join(p.message.content for p in parts) == whole.message.content != ""
    assert parts[-1].done and not any(p.done for p in parts[:-1])


@ONE_NODE
def test_ollama_lists_shows_and_generates(url):
    client = ollama.Client(host=url)
    assert [m.model for m in client.list().models] == [MODEL] == [m.model for m in client.ps().models]
    assert client.show(f"{MODEL}:latest").modelinfo["general.architecture"] == "llama"
    reply = client.generate(model=MODEL, prompt=HI, options={"num_predict": 12, "seed": 1})
    assert reply.response and reply.prompt_eval_count > 0
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert refused.value.status_code == 404 and MODEL in refused.value.error


@ONE_NODE
def test_ollama_two_step_tool_loop(url):
    """Shown one earlier call, the model calls the tool for a new city (within a few seeds: it is small); its
    arguments arrive as an object that validates; given the result, it answers."""
    client = ollama.Client(host=url)
    tools = [
        {"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": WEATHER}}
    ]
    conversation = [
        {"role": "user", "content": "What is the weather in Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}],
        },
        {"role": "tool", "content": "20 degrees, cloudy", "tool_name": "get_weather"},
        {"role": "assistant", "content": "It is 20 degrees and cloudy in Rome."},
        {"role": "user", "content": "What is the weather in Berlin?"},
    ]
    # the whole vocabulary at temperature 1 (not Ollama's defaults, under which this small model answers in text)
    sampling = {"num_predict": 60, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    for seed in range(8):
        first = client.chat(model=MODEL, messages=conversation, tools=tools, options=sampling | {"seed": seed})
        if first.message.tool_calls:
            break
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(dict(call.function.arguments), closed_objects(WEATHER))
    conversation += [first.message, {"role": "tool", "content": "14 degrees, sunny", "tool_name": "get_weather"}]
    final = client.chat(model=MODEL, messages=conversation, tools=tools, options={"num_predict": 30, "temperature": 0})
    assert final.message.content or final.message.tool_calls


@ONE_NODE
def test_ollama_format_schema_gives_json_of_the_schema(url):
    client = ollama.Client(host=url)
    reply = client.chat(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris."}],
        format=City.model_json_schema(),
        options={"num_predict": 80, "temperature": 0},
    )
    assert isinstance(City.model_validate_json(reply.message.content), City)


# -- Anthropic Messages -----------------------------------------------------------------------------------------
GREEDY = {"temperature": 0}  # the Messages API takes it; this SDK's signature no longer names it


def anthropic_client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)


def test_anthropic_streamed_message_is_the_whole_message(url):
    client = anthropic_client(url)
    kw = dict(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": HI}], extra_body=GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert whole.content[0].text == text == final.content[0].text != ""
    assert whole.stop_reason == final.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens == final.usage.output_tokens


@ONE_NODE
def test_anthropic_multi_turn_with_a_system_prompt_and_a_stop_sequence(url):
    client = anthropic_client(url)
    turns = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": [{"type": "text", "text": "Nice to meet you, Ada."}]},
        {"role": "user", "content": [{"type": "text", "text": "What is my name?"}]},
    ]
    reply = client.messages.create(
        model=MODEL, max_tokens=30, system="Answer briefly.", messages=turns, extra_body=GREEDY
    )
    assert reply.content[0].text and reply.stop_reason in ("end_turn", "max_tokens")
    first = reply.content[0].text.split()[0]
    stopped = client.messages.create(
        model=MODEL, max_tokens=30, system="Answer briefly.", messages=turns, stop_sequences=[first], extra_body=GREEDY
    )
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", first)


def test_anthropic_two_step_tool_loop(url):
    client = anthropic_client(url)
    tools = [{"name": "get_weather", "description": DESCRIPTION, "input_schema": WEATHER}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    first = client.messages.create(
        model=MODEL, max_tokens=60, messages=ask, tools=tools, tool_choice=choice, extra_body=GREEDY
    )
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    jsonschema.validate(use.input, closed_objects(WEATHER))
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "18 degrees, sunny"}
    turns = ask + [{"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    final = client.messages.create(model=MODEL, max_tokens=30, messages=turns, tools=tools, extra_body=GREEDY)
    assert final.content and final.stop_reason in ("end_turn", "max_tokens", "tool_use")


@ONE_NODE
def test_anthropic_streamed_tool_use_is_the_same_call(url):
    client = anthropic_client(url)
    kw = dict(
        model=MODEL,
        max_tokens=60,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[{"name": "get_weather", "description": DESCRIPTION, "input_schema": WEATHER}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    pick = lambda m: [(b.name, b.input) for b in m.content if b.type == "tool_use"]  # noqa: E731
    assert pick(whole) == pick(final) and len(pick(final)) == 1 and final.stop_reason == "tool_use"


class Capital(BaseModel):
    """Bounded by its types alone: the SDK drops numeric and length bounds from the schema it sends."""

    city: Literal["Paris", "Rome", "Berlin"]
    is_capital: bool


@ONE_NODE
def test_anthropic_parse_gives_the_pydantic_model(url):
    reply = anthropic_client(url).messages.parse(
        model=MODEL,
        max_tokens=40,
        messages=[{"role": "user", "content": "Is Paris a capital?"}],
        output_format=Capital,
        extra_body=GREEDY,
    )
    assert isinstance(reply.parsed_output, Capital)


# -- OpenAI Responses -------------------------------------------------------------------------------------------
def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_responses_streamed_deltas_add_up_to_the_whole_response(url):
    client = openai_client(url)
    kw = dict(model=MODEL, input=HI, instructions="Answer briefly.", max_output_tokens=16, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text != ""
    assert whole.usage.input_tokens > 0 and whole.status in ("completed", "incomplete")


@ONE_NODE
def test_responses_two_step_tool_loop_with_input_items(url):
    client = openai_client(url)
    tools = [{"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": WEATHER}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(
        model=MODEL, input=ask, tools=tools, tool_choice="required", parallel_tool_calls=False, max_output_tokens=60
    )
    (call,) = [o for o in first.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), closed_objects(WEATHER))
    items = ask + [call.model_dump(exclude_none=True)]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"})
    final = client.responses.create(model=MODEL, input=items, tools=tools, max_output_tokens=30, temperature=0)
    assert final.output_text or any(o.type == "function_call" for o in final.output)


@ONE_NODE
def test_responses_parse_gives_the_pydantic_model(url):
    client = openai_client(url)
    parsed = client.responses.parse(
        model=MODEL, input="Describe Paris.", text_format=City, max_output_tokens=80, temperature=0
    )
    assert isinstance(parsed.output_parsed, City)


@ONE_NODE
def test_responses_refuses_previous_response_id_as_nothing_is_stored(url):
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client(url).responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert refused.value.body["param"] == "previous_response_id"
