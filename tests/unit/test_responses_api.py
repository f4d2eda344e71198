"""The OpenAI Responses API's translation: bodies in, the typed ChatRequest of the chat path out; the typed events
back as the Responses event stream and the whole response it adds up to; and every hostile body a 4xx OpenAI
error object, never a 500. Nothing is stored, so what needs a stored response is refused by name."""

import json

import pytest

from node.http import responses
from node.http.chat import CallOut, Finished, TextOut
from node.http.tools import ToolCall
from tests.support.dialects import exchange

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather", "parameters": WEATHER}]


def test_a_string_input_with_instructions_is_a_system_and_a_user_message():
    req = responses.parse_response_request(
        {"model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0.3}
    )
    assert req.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (req.options.max_tokens, req.options.sampling.temperature, req.options.stream) == (9, 0.3, False)


def test_function_call_items_join_one_assistant_message_and_outputs_become_tool_messages():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris and Rome?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"},
    ]
    req = responses.parse_response_request({"model": "m", "input": items, "tools": TOOLS, "tool_choice": "required"})
    user, assistant, *results = req.messages
    assert user == {"role": "user", "content": "Weather in Paris and Rome?"}
    assert [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]
    assert assistant["tool_calls"][1]["function"]["arguments"] == {"city": "Rome"}
    assert results == [
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]
    assert req.options.structure.tool_choice == "required"


def test_text_format_json_schema_is_the_grammar_paths_schema():
    fmt = {"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}}
    req = responses.parse_response_request({"model": "m", "input": "x", "text": fmt})
    assert req.options.structure.json_schema == WEATHER


def test_the_stream_adds_items_parts_and_deltas_and_completes_with_the_whole_response():
    b = responses.ResponseBuilder({"model": "m", "tools": TOOLS}, "m", 4)
    call = ToolCall(0, "call_1", "get_weather", '{"city": "Paris"}')
    events = b.start()
    for e in (TextOut("Let me "), TextOut("check."), CallOut(call), Finished("tool_calls", 9)):
        events += b.feed(e)
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    whole = events[-1][1]["response"]
    assert whole == b.response and whole["status"] == "completed"
    message, fc = whole["output"]
    assert message["content"][0]["text"] == "Let me check." and message["status"] == "completed"
    assert (fc["call_id"], fc["name"], fc["arguments"]) == ("call_1", "get_weather", '{"city": "Paris"}')
    assert whole["usage"]["total_tokens"] == 13


def test_a_reply_cut_at_max_output_tokens_is_incomplete():
    b = responses.ResponseBuilder({}, "m", 1)
    events = b.feed(TextOut("a")) + b.feed(Finished("length", 5))
    assert events[-1][0] == "response.incomplete"
    assert b.response["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.parametrize("key", ["previous_response_id", "conversation", "background"])
def test_what_needs_a_stored_response_is_refused_by_name(key):
    [(status, _, text)] = exchange([("POST", "/v1/responses", {"model": "llama", "input": "x", key: "resp_1"})])
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == key and "stores no responses" in error["message"]


HOSTILE = [
    b"{not json",
    {"input": "x"},
    {"model": "nope", "input": "x"},
    {"model": "llama"},
    {"model": "llama", "input": []},
    {"model": "llama", "input": 5},
    {"model": "llama", "input": [7]},
    {"model": "llama", "input": [{"role": "wizard", "content": "x"}]},
    {"model": "llama", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
    {"model": "llama", "input": [{"type": "function_call", "call_id": "c"}]},
    {"model": "llama", "input": [{"type": "function_call_output", "call_id": "nobody", "output": "x"}]},
    {"model": "llama", "input": [{"type": "item_reference", "id": "msg_1"}]},
    {"model": "llama", "input": [{"type": "reasoning", "summary": []}]},
    {"model": "llama", "input": "x", "instructions": 5},
    {"model": "llama", "input": "x", "max_output_tokens": 0},
    {"model": "llama", "input": "x", "max_output_tokens": 10**9},
    {"model": "llama", "input": "x", "temperature": 9},
    {"model": "llama", "input": "x", "stream": "yes"},
    {"model": "llama", "input": "x", "tools": [{"type": "web_search"}]},
    {"model": "llama", "input": "x", "tools": [{"type": "function", "name": "a b"}]},
    {"model": "llama", "input": "x", "tools": TOOLS, "tool_choice": {"type": "function"}},
    {"model": "llama", "input": "x", "tools": TOOLS, "tool_choice": "sometimes"},
    {"model": "llama", "input": "x", "text": {"format": {"type": "json_schema", "schema": 5}}},
    {"model": "llama", "input": "x", "text": {"format": {"type": "xml"}}},
    {"model": "llama", "input": "x", "text": {"format": "json"}},
    {"model": "llama", "input": "x", "reasoning": {"effort": "high"}},
    {"model": "llama", "input": "x" * 100_000},
]


def test_every_hostile_body_is_a_4xx_openai_error_object():
    results = exchange([("POST", "/v1/responses", b) for b in HOSTILE])
    for b, (status, _, text) in zip(HOSTILE, results, strict=True):
        assert 400 <= status < 500, (b, status, text)
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (b, text)
