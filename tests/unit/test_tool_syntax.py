"""Each model family's own tool-call syntax: read off its chat template, written by the grammar, read back from the
model's text as OpenAI streams calls (a first delta naming the call, then argument fragments), and checked
against the tool's schema. The Llama and Mistral templates here are small ones written for these tests in their
formats' manner (what the published templates write for an assistant's calls and tool results)."""

from __future__ import annotations

import dataclasses
import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.http.tool_stream import CallStream
from node.http.tool_syntax import ToolSyntax, template_family, tool_syntax
from node.http.tools import ToolCallParser, prompt_inputs
from shards.decoding.grammar import Constraint, Matcher, closed_objects, grammar_tokenizer, tool_call_grammar
from shards.formats.packaged import resolve_model
from shards.formats.tokenizer import Tokenizer
from tests.unit.test_http_tools import TOOL_TEMPLATE, chat

LLAMA_TEMPLATE = """{{- bos_token }}
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Environment: ipython
Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>
{%- endif %}
{%- for m in messages %}
{%- if m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{{ '{"name": "' + m.tool_calls[0].function.name + '", "parameters": ' }}{{ m.tool_calls[0].function.arguments | tojson }}}<|eot_id|>
{%- elif m.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL_TEMPLATE = """{{- bos_token }}
{%- for m in messages %}
{%- if m.role == "user" %}
{%- if tools and loop.first %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]
{%- elif m.tool_calls %}[TOOL_CALLS][
{%- for c in m.tool_calls %}{"name": {{ c.function.name | tojson }}, "arguments": {{ c.function.arguments | tojson }}, "id": {{ c.id | tojson }}}
{%- if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}
{%- elif m.role == "tool" %}[TOOL_RESULTS]{"content": {{ m.content | tojson }}, "call_id": {{ m.tool_call_id | tojson }}}[/TOOL_RESULTS]
{%- else %}{{ m.content }}{{ eos_token }}
{%- endif %}
{%- endfor %}"""

# family -> (template, the text between which and the end of turn the template writes an assistant's calls)
TEMPLATES = {
    "hermes": (TOOL_TEMPLATE, r"<\|im_start\|>assistant\n?(.*?)<\|im_end\|>"),
    "llama": (LLAMA_TEMPLATE, r"assistant<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>"),
    "mistral": (MISTRAL_TEMPLATE, r"(\[TOOL_CALLS\].*?)</s>"),
}
PLACE = {
    "type": "object",
    "$defs": {"Point": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}}},
    "properties": {"city": {"type": "string", "maxLength": 12}, "at": {"$ref": "#/$defs/Point"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "find", "description": "Find a place", "parameters": PLACE}},
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        },
    },
]
SCHEMAS = {t["function"]["name"]: closed_objects(t["function"]["parameters"]) for t in TOOLS}


def read_calls(family: str, text: str, cut: int) -> tuple[str, list[dict]]:
    """The text fed to a CallStream in pieces of `cut` characters: its content, and its calls folded from their
    deltas (checking the deltas' shape as they come)."""
    stream, content, calls = CallStream(family), "", {}
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)] or [""]
    for k, piece in enumerate(pieces):
        c, deltas = stream.feed(piece, final=k == len(pieces) - 1)
        content += c
        for d in deltas:
            if d.id is not None:
                assert d.index not in calls and d.arguments == "" and d.index == len(calls)
                calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
            else:
                calls[d.index]["arguments"] += d.arguments
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("family", TEMPLATES)
def test_the_family_is_read_off_the_template(family):
    template = TEMPLATES[family][0]
    assert template_family(template) == family and tool_syntax(template).native
    assert template_family("{{ messages }}") == "generic" and not tool_syntax(None).native


@pytest.mark.parametrize("cut", [1, 5, 64])
@pytest.mark.parametrize("family", TEMPLATES)
def test_a_call_the_template_writes_is_read_back_and_validates(family, cut):
    template, turn = TEMPLATES[family]
    tok = Tokenizer.__new__(Tokenizer)  # only the template matters here
    tok.chat_template, tok.bos_token, tok.eos_token = template, "<s>", "</s>"
    arguments = {"city": "Oslo", "at": {"lat": 59.9, "lon": 10.7}}
    call = {"id": "a1B2c3D4e", "type": "function", "function": {"name": "find", "arguments": arguments}}
    req = chat(
        tools=TOOLS,
        messages=[
            {"role": "user", "content": "Where is Oslo?"},
            {
                "role": "assistant",
                "tool_calls": [call | {"function": {"name": "find", "arguments": json.dumps(arguments)}}],
            },
            {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": "found"},
        ],
    )
    structure = dataclasses.replace(req.options.structure, syntax=tool_syntax(template))
    messages, tools = prompt_inputs(req.messages, structure, template)
    assert tools == TOOLS and messages is req.messages  # the template renders tools and calls itself
    written = re.search(turn, tok.render_chat(messages, tools=tools), re.S).group(1)
    content, calls = read_calls(family, written, cut)
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [("find", arguments)]
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["find"])
    if family == "mistral":
        assert re.fullmatch("[A-Za-z0-9]{9}", calls[0]["id"])  # its templates refuse any other id


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(resolve_model("smollm2")[0])


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(1, thread_name_prefix="grammar") as ex:
        yield ex


def sample(tok, grammar: str, seed: int, pool, favour: int | None = None) -> list[int]:
    """Random logits (a model that knows nothing) through the grammar until end of sequence."""
    matcher, rng, ids = Matcher(grammar_tokenizer(tok), Constraint(grammar), pool), np.random.default_rng(seed), []
    for _ in range(400):
        logits = rng.standard_normal(tok.vocab_size).astype(np.float32)
        logits[sorted(tok.eos_token_ids)] += 4.0
        if favour is not None:
            logits[favour] += 30.0  # a model trained to open its calls with this token
        token = int(np.argmax(matcher.apply(logits)))
        matcher.advance(token)
        ids.append(token)
        if token in tok.eos_token_ids:
            return ids[:-1]
    raise AssertionError(f"no end of sequence: {tok.decode(ids)!r}")


SYNTAXES = {
    "hermes": ToolSyntax("hermes"),
    "llama": ToolSyntax("llama"),
    "mistral, [TOOL_CALLS] spelled": ToolSyntax("mistral"),
    "mistral, [TOOL_CALLS] one special token": ToolSyntax("mistral", marker_token=1),  # SmolLM2's <|im_start|>
}


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("name", SYNTAXES)
def test_calls_the_grammar_writes_in_each_syntax_are_read_back_and_validate(tok, pool, name, seed):
    syntax = SYNTAXES[name]
    tools = [(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS]
    for parallel in (False, True):
        grammar = tool_call_grammar(tools, required=True, parallel=parallel, syntax=syntax.call)
        ids = sample(tok, grammar, seed, pool, favour=syntax.marker_token)
        text = tok.decode(ids)  # special tokens skipped, as the entry decodes replies
        content, calls = read_calls(syntax.call_family, text, cut=3)
        assert content == "" and calls, text
        assert parallel or len(calls) == 1
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        if syntax.family == "llama":
            assert text.startswith('{"name":') and '"parameters":' in text
        if syntax.family == "mistral" and syntax.marker_token is None:
            assert text.startswith("[TOOL_CALLS][{")


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_llama_and_mistral_replies_are_text_or_calls_told_apart_at_the_start(tok, family):
    grammar = tool_call_grammar(
        [("add", TOOLS[1]["function"]["parameters"])], required=False, parallel=True, syntax=ToolSyntax(family).call
    )
    gt = grammar_tokenizer(tok)
    opener = "" if family == "llama" else "[TOOL_CALLS]["
    bad = "{x} or [y]" if family == "llama" else "[y] or {x}"  # text may not start as calls do
    for text, ok in [("Sure, it is 4.", True), (opener + '{"name":"add"', True), (bad, False), ("", True)]:
        prefix = tuple(tok.encode(text, False))
        try:
            Matcher(gt, Constraint(grammar, prefix))
            accepted = True
        except Exception:
            accepted = False
        assert accepted == ok, text
    assert read_calls(family, "Sure, {it} is [4].", cut=2) == ("Sure, {it} is [4].", [])


def test_text_around_calls_is_content_and_an_unfinished_call_stays_a_call_while_streaming():
    text = 'Let me look. <tool_call>\n{"name":"add","arguments":{"x":1}}\n</tool_call>'
    content, calls = read_calls("hermes", text, cut=4)
    assert content == "Let me look." and [(c["name"], c["arguments"]) for c in calls] == [("add", '{"x":1}')]
    content, calls = read_calls("hermes", '<tool_call>\n{"name":"add","arguments":{"x":12', cut=3)
    assert content == "" and calls[0]["arguments"] == '{"x":12'  # cut short by max_tokens, as OpenAI's are
    assert read_calls("hermes", '<tool_call>\n{"nam', cut=3) == ('<tool_call>\n{"nam', [])  # never named: text


def test_arguments_stream_in_fragments_before_the_call_ends():
    text = '<tool_call>\n{"name":"find","arguments":{"city":"Oslo \\"centre\\"","at":{"lat":1,"lon":2}}}\n</tool_call>'
    stream = CallStream("hermes")
    fragments = [d for i in range(0, len(text), 6) for d in stream.feed(text[i : i + 6])[1]]
    first, rest = fragments[0], fragments[1:]
    assert first.openai() == {
        "index": 0,
        "id": first.id,
        "type": "function",
        "function": {"name": "find", "arguments": ""},
    }
    assert len(rest) > 5 and all(d.openai() == {"index": 0, "function": {"arguments": d.arguments}} for d in rest)
    assert json.loads("".join(d.arguments for d in rest)) == {"city": 'Oslo "centre"', "at": {"lat": 1, "lon": 2}}


def test_whole_calls_for_dialects_that_send_them_whole():
    parser = ToolCallParser("mistral")
    content, calls = parser.feed(
        '[TOOL_CALLS][{"name":"add","arguments":{"x":1}},{"name":"add","arguments":{"x":2}}]', final=True
    )
    assert content == "" and [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [
        (0, "add", {"x": 1}),
        (1, "add", {"x": 2}),
    ]


def test_a_native_template_shows_tools_only_when_the_grammar_enforces_its_syntax():
    req = chat(tools=TOOLS, messages=[{"role": "user", "content": "Where is Oslo?"}])
    generic = req.options.structure  # the model not yet known: hermes calls, tools described by us
    messages, tools = prompt_inputs(req.messages, generic, LLAMA_TEMPLATE)
    assert tools is None and "<tool_call>" in messages[0]["content"]
    llama = dataclasses.replace(generic, syntax=tool_syntax(LLAMA_TEMPLATE))
    assert prompt_inputs(req.messages, llama, LLAMA_TEMPLATE) == (req.messages, TOOLS)


def test_the_entry_constrains_calls_in_the_serving_models_syntax(tok):
    """with_tool_syntax reads the model's template (and, for Mistral, whether [TOOL_CALLS] is one token of its
    vocabulary): the grammar then asks for that family's calls."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers.models import WordLevel

    from node.http.tools import with_tool_syntax

    hf = HfTokenizer(WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    hf.add_special_tokens(["[TOOL_CALLS]"])
    req = chat(tools=TOOLS, messages=[{"role": "user", "content": "Where is Oslo?"}])
    for template, vocab, family, marker in [
        (LLAMA_TEMPLATE, None, "llama", None),
        (MISTRAL_TEMPLATE, hf, "mistral", 2),
        (TOOL_TEMPLATE, None, "hermes", None),
        ("{{ messages }}", None, "generic", None),
    ]:
        model = Tokenizer.__new__(Tokenizer)
        model.chat_template, model.hf = template, vocab
        structure = with_tool_syntax(req, model).options.structure
        assert structure.syntax == ToolSyntax(family, marker)
        grammar = structure.grammar()
        assert ('"parameters"' in grammar) == (family == "llama") and ("<[2]>" in grammar) == (marker == 2)
    assert with_tool_syntax(chat(), model) == chat()  # no tools: nothing to read


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
WRITTEN = {  # family -> one call as the grammar writes it (compact JSON, name first)
    "hermes": lambda a: '<tool_call>\n{"name":"f","arguments":' + a + "}\n</tool_call>",
    "llama": lambda a: '{"name":"f","parameters":' + a + "}",
    "mistral": lambda a: '[TOOL_CALLS][{"name":"f","arguments":' + a + "}]",
}


@settings(max_examples=60, deadline=None)
@given(
    family=st.sampled_from(sorted(WRITTEN)),
    arguments=st.dictionaries(st.text(max_size=6), JSON, max_size=4),
    cuts=st.lists(st.integers(1, 9), min_size=1, max_size=40),
)
def test_any_arguments_come_back_exactly_however_the_text_is_cut(family, arguments, cuts):
    """Strings with quotes, braces and escapes inside: the arguments' end is found by scanning, never guessed."""
    args = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
    text, stream, content, joined, k = WRITTEN[family](args), CallStream(family), "", "", 0
    for cut in cuts * (len(text) // len(cuts) + 1):
        piece, k = text[k : k + cut], k + cut
        c, deltas = stream.feed(piece, final=k >= len(text))
        content += c
        joined += "".join(d.arguments for d in deltas)
        if k >= len(text):
            break
    assert content == "" and joined == args and stream.calls == 1
