"""tools / tool_choice / response_format as the API reads them, tool messages in the conversation, and tool calls
read back out of streamed text: bad input is a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from node.http.completion import TextDelta
from node.http.format import ChatFormat
from node.http.schema import ApiError, parse_chat, parse_completion
from node.http.tools import ToolCallParser, ToolError, generic_messages, knows_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
USER = [{"role": "user", "content": "Weather in Oslo?"}]


def chat(**kw):
    return parse_chat({"model": "m", "messages": kw.pop("messages", USER), **kw})


def refused(param: str, **kw) -> str:
    with pytest.raises(ApiError) as e:
        chat(**kw)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    return e.value.message


def test_tools_and_tool_choice_are_read():
    s = chat(
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    ).options.structure
    assert [t.name for t in s.tools] == ["get_weather"] and s.tool_choice == "get_weather" and not s.parallel
    assert s.grammar() and s.calls_tools
    assert chat(tools=[WEATHER], tool_choice="none").options.structure.grammar() is None
    assert chat().options.structure.grammar() is None


@pytest.mark.parametrize(
    "kw, param, says",
    [
        (
            dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
            "not one of the tools",
        ),
        (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", "must be"),
        (dict(tool_choice="auto"), "tool_choice", "only allowed when 'tools'"),
        (
            dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
            "tools[0].function.name",
            "[A-Za-z0-9_-]",
        ),
        (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name", "two tools"),
        (
            dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
            "tools[0].function.parameters",
            "JSON Schema object",
        ),
        (dict(tools=[{"type": "retrieval"}]), "tools[0]", '"type": "function"'),
        (dict(parallel_tool_calls="yes", tools=[WEATHER]), "parallel_tool_calls", "boolean"),
        (dict(functions=[{"name": "f"}]), "functions", "use 'tools'"),
        (dict(response_format={"type": "yaml"}), "response_format", "json_schema"),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format.json_schema",
            "schema",
        ),
        (dict(messages=USER + [{"role": "tool", "content": "12C"}]), "messages[1].tool_call_id", "tool_call_id"),
        (
            dict(messages=USER + [{"role": "tool", "content": "12C", "tool_call_id": "c9"}]),
            "messages[1].tool_call_id",
            "no earlier assistant message called",
        ),
        (
            dict(
                messages=USER
                + [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    }
                ]
            ),
            "messages[1].tool_calls[0].function.arguments",
            "JSON string",
        ),
    ],
)
def test_bad_tool_input_is_a_400_naming_the_field(kw, param, says):
    assert says in refused(param, **kw)


def test_completions_take_response_format_but_not_tools():
    req = parse_completion({"model": "m", "prompt": "x", "response_format": {"type": "json_object"}})
    assert req.options.structure.json_schema == {"type": "object"}
    with pytest.raises(ApiError, match="only supported on /v1/chat/completions"):
        parse_completion({"model": "m", "prompt": "x", "tools": [WEATHER]})


def test_a_conversation_with_calls_and_results_renders_generically():
    req = chat(
        tools=[WEATHER],
        messages=USER
        + [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "12C, rain"},
        ],
    )
    msgs = generic_messages(req.messages, [WEATHER])
    assert msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"] and "<tool_call>" in msgs[0]["content"]
    assert msgs[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    }
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n12C, rain\n</tool_response>"}
    assert knows_tools("{% if tools %}...<tool_call>{% endif %}") and not knows_tools("{{ messages }}")


CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'


@pytest.mark.parametrize("cut", [1, 3, 7, 12, 40])
def test_streamed_text_splits_into_content_and_calls_wherever_it_is_cut(cut):
    text = "Let me look. " + CALL + "\n" + CALL.replace("Oslo", "Bergen")
    parser, content, calls = ToolCallParser(), "", []
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
    for k, piece in enumerate(pieces):
        c, found = parser.feed(piece, final=k == len(pieces) - 1)
        assert "<" not in c  # no part of a call leaks into the content
        content, calls = content + c, calls + found
    assert content == "Let me look."
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Oslo"}),
        (1, "get_weather", {"city": "Bergen"}),
    ]


def test_text_without_calls_and_unfinished_calls_stay_content():
    parser = ToolCallParser()
    assert parser.feed("a < b and <tool") == ("a < b and", [])
    assert parser.feed("", final=True) == (" <tool", [])
    cut_short = ToolCallParser()
    assert cut_short.feed('<tool_call>\n{"name":"get_w', final=True) == ('<tool_call>\n{"name":"get_w', [])


def test_the_chat_format_folds_calls_into_the_message_with_finish_reason_tool_calls():
    fmt = ChatFormat(chat(tools=[WEATHER]).options, 10, "m")
    pieces = [
        TextDelta(CALL[:20], completion_tokens=5),
        TextDelta(CALL[20:], finish_reason="stop", completion_tokens=9),
    ]
    choice = fmt.whole(pieces, "")["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo"}'}


def test_a_streamed_call_is_a_named_first_delta_then_argument_fragments():
    fmt = ChatFormat(chat(tools=[WEATHER], stream=True).options, 10, "m")
    cuts = [0, 14, 40, 52, 60, len(CALL)]
    pieces = [TextDelta(CALL[a:b], finish_reason="stop" if b == len(CALL) else None) for a, b in zip(cuts, cuts[1:])]
    deltas = [d for p in pieces for c in fmt.piece_chunks(p) for d in c["choices"][0]["delta"].get("tool_calls", ())]
    first, *rest = deltas
    assert first == {
        "index": 0,
        "id": first["id"],
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert len(rest) >= 2 and all(d.keys() == {"index", "function"} for d in rest)
    assert "".join(d["function"]["arguments"] for d in rest) == '{"city":"Oslo"}'
    assert fmt.piece_chunks(TextDelta("", finish_reason="stop"))[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_parallel_calls_are_allowed_unless_turned_off_and_a_response_format_may_come_with_tools():
    assert chat(tools=[WEATHER]).options.structure.parallel  # OpenAI's default
    assert not chat(tools=[WEATHER], parallel_tool_calls=False).options.structure.parallel
    s = chat(tools=[WEATHER], response_format={"type": "json_object"}).options.structure
    assert s.json_schema == {"type": "object"} and s.calls_tools and s.grammar()


# A template in the Hermes/Qwen manner (written for this test): it lists `tools` and renders calls and results.
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool.function | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "tool" %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.tool_calls %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_template_that_knows_tools_renders_them_and_the_calls_itself():
    from node.http.tools import prompt_inputs
    from shards.formats.tokenizer import Tokenizer

    tok = Tokenizer.__new__(Tokenizer)  # only the template matters here
    tok.chat_template, tok.bos_token, tok.eos_token = TOOL_TEMPLATE, None, "<|im_end|>"
    req = chat(
        tools=[WEATHER],
        messages=USER
        + [
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "12C"},
        ],
    )
    messages, tools = prompt_inputs(req.messages, req.options.structure, tok.chat_template)
    assert tools == [WEATHER] and messages is req.messages  # no system prompt of ours
    text = tok.render_chat(messages, tools=tools)
    assert '{"description": "Weather in a city", "name": "get_weather"' in text.split("</tools>")[0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\n12C\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("depth", [600, 3000])
def test_a_schema_nested_too_deeply_is_a_400_not_a_crash(depth):
    params = {"type": "string"}
    for _ in range(depth):
        params = {"type": "array", "items": params}
    with pytest.raises((ApiError, ToolError), match="nested too deeply"):
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": params}}]).options.structure.grammar()


def test_a_bad_tool_schema_is_refused_naming_the_tool_and_its_own_pointer():
    params = {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}
    tools = [WEATHER, {"type": "function", "function": {"name": "broken", "parameters": params}}]
    with pytest.raises(ToolError) as e:
        chat(tools=tools).options.structure.grammar()
    assert "tool 'broken'" in str(e.value) and "'/$defs/Missing' does not exist" in str(e.value)
    assert "anyOf" not in str(e.value) and "%json" not in str(e.value)
    with pytest.raises(ToolError, match="oneOf"):
        overlap = {"type": "object", "properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": overlap}}]).options.structure.grammar()
