"""The Anthropic Messages API's translation: bodies in, the typed ChatRequest of the OpenAI path out; the typed
events back as Anthropic's event stream and the whole message it adds up to; and every hostile body a 4xx
Anthropic error object, never a 500."""

import json

from node.http import anthropic
from node.http.api import ApiSettings
from node.http.chat import CallOut, Finished, TextOut
from node.http.schema import ApiError
from node.http.tools import ToolCall
from tests.support.dialects import exchange

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "The weather", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def body(**fields):
    return {"model": "m", "max_tokens": 50, "messages": ASK} | fields


def test_system_blocks_stop_sequences_and_sampling_are_translated():
    req = anthropic.parse_messages(
        body(
            system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            stop_sequences=["\n\n"],
            temperature=0.5,
            top_p=0.9,
            top_k=5,
            stream=True,
        )
    )
    assert req.messages[0] == {"role": "system", "content": "Be brief."}
    o = req.options
    assert (o.max_tokens, o.stop, o.stream) == (50, ("\n\n",), True)
    assert (o.sampling.temperature, o.sampling.top_p, o.sampling.top_k) == (0.5, 0.9, 5)


def test_tool_use_and_tool_result_blocks_become_calls_and_tool_messages():
    turns = ASK + [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    req = anthropic.parse_messages(body(messages=turns, tools=TOOLS))
    assistant, result, user = req.messages[1:]
    assert assistant["content"] == "Checking."
    assert assistant["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert result == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
    assert user == {"role": "user", "content": "And tomorrow?"}


def test_tool_choice_any_is_required_a_named_tool_is_that_tool_and_parallel_is_the_default():
    assert anthropic.parse_messages(body(tools=TOOLS)).options.structure.tool_choice == "auto"
    s = anthropic.parse_messages(body(tools=TOOLS, tool_choice={"type": "any"})).options.structure
    assert (s.tool_choice, s.parallel) == ("required", True)
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    s = anthropic.parse_messages(body(tools=TOOLS, tool_choice=choice)).options.structure
    assert (s.tool_choice, s.parallel) == ("get_weather", False)


def test_the_stream_is_message_start_blocks_deltas_and_message_stop_and_folds_to_the_message():
    b = anthropic.MessageBuilder("m", 7)
    call = ToolCall(0, "toolu_9", "get_weather", '{"city": "Paris"}')
    events = b.start()
    for e in (TextOut("Let me "), TextOut("check."), CallOut(call), Finished("tool_calls", 11)):
        events += b.feed(e)
    names = [name for name, _ in events]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    assert events[0][1]["message"]["content"] == [] and events[2][1]["content_block"] == {"type": "text", "text": ""}
    assert events[7][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}
    assert events[9][1]["delta"]["stop_reason"] == "tool_use" and events[9][1]["usage"] == {"output_tokens": 11}
    assert b.message["content"] == [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_9", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert b.message["usage"] == {"input_tokens": 7, "output_tokens": 11}


def test_stop_reasons_say_why_the_message_ended():
    for finished, reason in [
        (Finished("stop", 1), "end_turn"),
        (Finished("length", 1), "max_tokens"),
        (Finished("stop", 1, "END"), "stop_sequence"),
    ]:
        b = anthropic.MessageBuilder("m", 1)
        b.feed(finished)
        assert b.message["stop_reason"] == reason
        assert b.message["stop_sequence"] == finished.stop_sequence


def test_errors_are_anthropic_error_objects():
    for status, kind in [(400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error")]:
        assert anthropic.error_body(ApiError(status, "no")) == {
            "type": "error",
            "error": {"type": kind, "message": "no"},
        }
    assert anthropic.error_body(ApiError(503, "busy"))["error"]["type"] == "overloaded_error"


HOSTILE = [
    b"{not json",
    [1],
    {"max_tokens": 5, "messages": ASK},
    {"model": "nope", "max_tokens": 5, "messages": ASK},
    {"model": "llama", "messages": ASK},
    {"model": "llama", "max_tokens": 0, "messages": ASK},
    {"model": "llama", "max_tokens": "5", "messages": ASK},
    {"model": "llama", "max_tokens": 10**9, "messages": ASK},
    {"model": "llama", "max_tokens": 5, "messages": []},
    {"model": "llama", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
    {"model": "llama", "max_tokens": 5, "messages": [{"role": "user", "content": 5}]},
    {"model": "llama", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
    {"model": "llama", "max_tokens": 5, "messages": [{"role": "user", "content": [7]}]},
    {"model": "llama", "max_tokens": 5, "messages": ASK + [{"role": "assistant", "content": "Sure"}]},
    {"model": "llama", "max_tokens": 5, "messages": ASK, "system": 5},
    {"model": "llama", "max_tokens": 5, "messages": ASK, "temperature": 1.5},
    {"model": "llama", "max_tokens": 5, "messages": ASK, "stop_sequences": "END"},
    {"model": "llama", "max_tokens": 5, "messages": ASK, "stream": "yes"},
    {"model": "llama", "max_tokens": 5, "messages": ASK, "tools": [{"name": "x y", "input_schema": WEATHER}]},
    {"model": "llama", "max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "w"}]},
    {"model": "llama", "max_tokens": 5, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "maybe"}},
    {"model": "llama", "max_tokens": 5, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "z"}},
    {"model": "llama", "max_tokens": 5, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}},
    {
        "model": "llama",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "3"}]}],
    },
    {"model": "llama", "max_tokens": 5, "messages": [{"role": "user", "content": "x" * 100_000}]},
]


def test_every_hostile_body_is_a_4xx_anthropic_error_object():
    results = exchange([("POST", "/v1/messages", b) for b in HOSTILE] + [("GET", "/v1/messages", None)])
    for b, (status, _, text) in zip(HOSTILE + [None], results, strict=True):
        assert 400 <= status < 500, (b, status, text)
        error = json.loads(text)
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, (b, text)
        assert error["error"]["message"], (b, text)


def test_the_api_key_is_taken_from_x_api_key_as_anthropic_clients_send_it():
    ok = {"model": "llama", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    [(status, _, text)] = exchange([("POST", "/v1/messages", ok)], ApiSettings(api_key="sesame"))
    assert status == 401 and json.loads(text)["error"]["type"] == "authentication_error"
    [(status, _, text)] = exchange(
        [("POST", "/v1/messages", ok)], ApiSettings(api_key="sesame"), {"x-api-key": "sesame"}
    )
    assert status == 200 and json.loads(text)["usage"]["output_tokens"] == 2


def test_output_config_format_is_the_grammar_paths_schema():
    fmt = {"type": "json_schema", "schema": WEATHER}
    assert anthropic.parse_messages(body(output_config={"format": fmt})).options.structure.json_schema == WEATHER
    [(status, _, text)] = exchange([("POST", "/v1/messages", body(model="llama", output_config={"format": "json"}))])
    assert status == 400 and "output_config.format" in json.loads(text)["error"]["message"]
