"""The Ollama API's translation: Ollama bodies in, the typed ChatRequest of the OpenAI path out; the typed events
back as Ollama's NDJSON lines and whole answers; and every hostile body a 4xx in Ollama's shape, never a 500."""

import json

import pytest

from node.http import ollama
from node.http.api import ApiSettings
from node.http.chat import CallOut, Finished, TextOut
from node.http.schema import ApiError
from node.http.tools import ToolCall
from shards.decoding.penalties import MAX_PENALTY_WINDOW
from tests.support.dialects import exchange

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_options_map_onto_sampling_and_streaming_is_the_default():
    req, stream = ollama.parse_chat(
        {
            "model": "m",
            "messages": ASK,
            "options": {"temperature": 0.2, "top_p": 0.5, "top_k": 7, "seed": 3, "num_predict": 9, "stop": ["\n"]},
        }
    )
    s = req.options.sampling
    assert stream is True
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.2, 0.5, 7, 3)
    assert (req.options.max_tokens, req.options.stop) == (9, ("\n",))


def test_penalty_options_map_onto_the_samplers_penalties():
    options = {"repeat_penalty": 1.1, "repeat_last_n": 32, "presence_penalty": 0.5, "frequency_penalty": 0.25}
    req, _ = ollama.parse_chat({"model": "m", "messages": ASK, "options": options | {"min_p": 0.05}})
    s = req.options.sampling
    assert (s.repetition_penalty, s.penalty_last_n, s.presence_penalty, s.frequency_penalty, s.min_p) == (
        1.1,
        32,
        0.5,
        0.25,
        0.05,
    )


OLLAMAS_DEFAULTS = (0.8, 40, 0.9, 1.0, 64, None)  # temperature, top_k, top_p, repeat_penalty, repeat_last_n, seed


def sampled_as(sampling) -> tuple:
    s = sampling
    return (s.temperature, s.top_k, s.top_p, s.repetition_penalty, s.penalty_last_n, s.seed)


@pytest.mark.parametrize("options", [None, {}, {"temperature": None, "top_k": None, "seed": None}, {"num_ctx": 8192}])
def test_a_request_naming_no_option_samples_with_ollamas_defaults_not_the_openai_apis(options):
    """Ollama's api.DefaultOptions, as a client that names nothing (Open WebUI, `ollama.chat`) gets from Ollama:
    temperature 0.8, top_k 40, top_p 0.9, no seed; no repeat penalty, as Ollama's own engine applies none. Not
    temperature 1 over the whole vocabulary (the OpenAI API's defaults); an option sent as null is one left out."""
    body = {"model": "m", "messages": ASK} | ({} if options is None else {"options": options})
    chat, _ = ollama.parse_chat(body)
    generate, _ = ollama.parse_generate(
        {"model": "m", "prompt": "hi"} | ({} if options is None else {"options": options})
    )
    assert sampled_as(chat.options.sampling) == sampled_as(generate.options.sampling) == OLLAMAS_DEFAULTS
    assert chat.options.sampling.min_p == 0 and chat.options.sampling.presence_penalty == 0


@pytest.mark.parametrize(
    "option, value, at",
    [("temperature", 0, 0), ("top_k", 0, 1), ("top_p", 1.0, 2), ("repeat_penalty", 1.1, 3), ("repeat_last_n", 0, 4)],
)
def test_an_option_given_replaces_its_default_alone(option, value, at):
    req, _ = ollama.parse_chat({"model": "m", "messages": ASK, "options": {option: value}})
    expected = list(OLLAMAS_DEFAULTS)
    expected[at] = value
    assert sampled_as(req.options.sampling) == tuple(expected)


def test_seed_minus_one_draws_afresh_and_repeat_last_n_minus_one_is_the_longest_window():
    """Ollama's -1s: `seed` -1 (its default) is no seed, so two requests draw differently; `repeat_last_n` -1 is
    the whole context there, the longest window (4,096 tokens) here. Any other seed is a seed."""
    req, _ = ollama.parse_chat({"model": "m", "messages": ASK, "options": {"seed": -1, "repeat_last_n": -1}})
    assert req.options.sampling.seed is None and req.options.sampling.penalty_last_n == MAX_PENALTY_WINDOW == 4096
    req, _ = ollama.parse_chat({"model": "m", "messages": ASK, "options": {"seed": 0}})
    assert req.options.sampling.seed == 0


@pytest.mark.parametrize("n", [-1, -2])
def test_num_predict_minus_one_or_two_leaves_the_length_to_the_node(n):
    req, _ = ollama.parse_chat({"model": "m", "messages": ASK, "options": {"num_predict": n}, "stream": False})
    assert req.options.max_tokens is None


def test_runtime_options_are_ignored_as_ollama_ignores_what_it_cannot_use():
    req, _ = ollama.parse_chat({"model": "m", "messages": ASK, "options": {"num_ctx": 8192, "num_gpu": 1}})
    assert req.options.max_tokens is None


def test_format_json_and_a_schema_go_through_the_grammar_path():
    req, _ = ollama.parse_chat({"model": "m", "messages": ASK, "format": "json"})
    assert req.options.structure.json_schema == {"type": "object"}
    req, _ = ollama.parse_chat({"model": "m", "messages": ASK, "format": WEATHER})
    assert req.options.structure.json_schema == WEATHER
    assert req.options.structure.grammar() is not None


def test_tool_calls_with_object_arguments_become_calls_and_each_result_answers_its_call():
    messages = ASK + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"function": {"name": "add", "arguments": {"a": 1}}},
            ],
        },
        {"role": "tool", "content": "3", "tool_name": "add"},
        {"role": "tool", "content": "sunny"},
    ]
    req, _ = ollama.parse_chat({"model": "m", "messages": messages, "tools": TOOLS})
    calls = req.messages[1]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == [{"city": "Paris"}, {"a": 1}]
    assert req.messages[2]["tool_call_id"] == calls[1]["id"]  # by name
    assert req.messages[3]["tool_call_id"] == calls[0]["id"]  # the one left
    assert [t.name for t in req.options.structure.tools] == ["get_weather"]


def test_generate_is_its_prompt_and_system_as_a_chat():
    req, stream = ollama.parse_generate({"model": "m", "prompt": "hi", "system": "be brief", "stream": False})
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert stream is False


def test_events_become_ndjson_lines_whose_fold_is_the_whole_answer():
    call = ToolCall(0, "call_1", "get_weather", '{"city": "Paris"}')
    events = [TextOut("Let me "), TextOut("check."), CallOut(call), Finished("tool_calls", 12)]
    lines = [ollama.chunk("m", e, False, 5, 0.0) for e in events]
    assert [line["done"] for line in lines] == [False, False, False, True]
    assert lines[2]["message"]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # an object
    whole = ollama.fold(lines, False)
    assert whole["message"]["content"] == "Let me check."
    assert whole["message"]["tool_calls"] == lines[2]["message"]["tool_calls"]
    assert (whole["done_reason"], whole["prompt_eval_count"], whole["eval_count"]) == ("stop", 5, 12)
    gen = [ollama.chunk("m", e, True, 5, 0.0) for e in (TextOut("a"), TextOut("b"), Finished("length", 2))]
    assert ollama.fold(gen, True)["response"] == "ab" and gen[-1]["done_reason"] == "length"


def test_a_request_with_nothing_to_say_loads_the_model_as_ollama_answers_it():
    load = exchange(
        [("POST", "/api/chat", {"model": "llama", "messages": []}), ("POST", "/api/generate", {"model": "llama"})]
    )
    for status, _, text in load:
        assert status == 200 and json.loads(text)["done_reason"] == "load" and json.loads(text)["done"] is True


def test_an_error_is_ollamas_object():
    response = ollama.error_response(ApiError(503, "busy", retry_after=2))
    assert json.loads(response.body) == {"error": "busy"} and response.headers["Retry-After"] == "2"


HOSTILE = [
    ("POST", "/api/chat", b"{not json"),
    ("POST", "/api/chat", [1, 2]),
    ("POST", "/api/chat", {"messages": ASK}),
    ("POST", "/api/chat", {"model": "nope", "messages": ASK}),
    ("POST", "/api/chat", {"model": "llama", "messages": "hi"}),
    ("POST", "/api/chat", {"model": "llama", "messages": [7]}),
    ("POST", "/api/chat", {"model": "llama", "messages": [{"role": "wizard", "content": "x"}]}),
    ("POST", "/api/chat", {"model": "llama", "messages": ASK, "stream": "yes"}),
    ("POST", "/api/chat", {"model": "llama", "messages": ASK, "options": []}),
    ("POST", "/api/chat", {"model": "llama", "messages": ASK, "options": {"temperature": "hot"}}),
    ("POST", "/api/chat", {"model": "llama", "messages": ASK, "options": {"top_p": 7}}),
    ("POST", "/api/chat", {"model": "llama", "messages": ASK, "options": {"num_predict": 0}}),
    ("POST", "/api/chat", {"model": "llama", "messages": ASK, "options": {"num_predict": 10**9}}),
    ("POST", "/api/chat", {"model": "llama", "messages": ASK, "options": {"stop": [1]}}),
    ("POST", "/api/chat", {"model": "llama", "messages": ASK, "options": {"repeat_penalty": 0}}),
    ("POST", "/api/chat", {"model": "llama", "messages": ASK, "options": {"repeat_last_n": -2}}),
    ("POST", "/api/chat", {"model": "llama", "messages": ASK, "options": {"min_p": 1.5}}),
    ("POST", "/api/chat", {"model": "llama", "messages": ASK, "options": {"mirostat": 2}}),
    ("POST", "/api/chat", {"model": "llama", "messages": ASK, "options": {"seed": 1.5}}),
    ("POST", "/api/chat", {"model": "llama", "messages": ASK, "format": "yaml"}),
    ("POST", "/api/chat", {"model": "llama", "messages": ASK, "format": {"type": "nonsense"}}),
    ("POST", "/api/chat", {"model": "llama", "messages": ASK, "think": True}),
    ("POST", "/api/chat", {"model": "llama", "messages": ASK, "tools": [{"type": "function"}]}),
    ("POST", "/api/chat", {"model": "llama", "messages": ASK, "tools": "all"}),
    ("POST", "/api/chat", {"model": "llama", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}),
    ("POST", "/api/chat", {"model": "llama", "messages": [{"role": "tool", "content": "3"}]}),
    ("POST", "/api/chat", {"model": "llama", "messages": [{"role": "assistant", "tool_calls": [{"function": 1}]}]}),
    ("POST", "/api/chat", {"model": "llama", "messages": [{"role": "user", "content": "x" * 100_000}]}),
    ("POST", "/api/generate", {"model": "llama", "prompt": 5}),
    ("POST", "/api/generate", {"model": "llama", "prompt": "x", "raw": True}),
    ("POST", "/api/generate", {"model": "llama", "prompt": "x", "context": [1, 2]}),
    ("POST", "/api/generate", {"model": "llama", "prompt": "x", "system": ["a"]}),
    ("POST", "/api/show", {"model": "nope"}),
    ("POST", "/api/show", {}),
    ("GET", "/api/chat", None),
    ("POST", "/api/pull", {"model": "llama"}),
]


def test_every_hostile_body_is_a_4xx_in_ollamas_shape():
    for (_, path, body), (status, _, text) in zip(HOSTILE, exchange(HOSTILE), strict=True):
        assert 400 <= status < 500, (path, body, status, text)
        error = json.loads(text)
        assert list(error) == ["error"] and isinstance(error["error"], str) and error["error"], (body, text)


def test_a_refused_key_and_an_unread_stream_are_answered_in_ollamas_shape():
    requests = [
        ("GET", "/api/tags", None),
        (
            "POST",
            "/api/chat",
            b'{"model": "llama", "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 3}}',
        ),
    ]
    [(refused, _, text)] = exchange(requests[:1], ApiSettings(api_key="sesame"))
    assert refused == 401 and "API key" in json.loads(text)["error"]
    (tags, _, text), (chat, headers, lines) = exchange(requests)  # a body without Content-Type, as curl -d sends
    assert tags == 200 and json.loads(text)["models"][0]["name"] == "llama"
    assert chat == 200 and headers["Content-Type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in lines.splitlines()]
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] == 3
    assert all(not line["done"] for line in lines[:-1])
