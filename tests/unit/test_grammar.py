"""Grammar-constrained sampling on the packaged SmolLM2 tokenizer: whatever the logits, the output follows the
grammar; a replay continues exactly; bad and hostile grammars are refused with a reason."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import pytest

from shards.decoding.grammar import (
    Constraint,
    GrammarError,
    Matcher,
    closed_objects,
    discriminated_one_of,
    grammar_tokenizer,
    json_object_grammar,
    json_schema_grammar,
    relocated_refs,
    tool_call_grammar,
)
from shards.formats.packaged import resolve_model
from shards.formats.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "bird"]},
        "owner": {
            "type": "object",
            "required": ["name", "age"],
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "id": {
            "anyOf": [
                {"type": "integer", "minimum": 1, "maximum": 9999},
                {"type": "string", "pattern": "^id-[0-9]{3}$"},
            ]
        },
        "weight": {"type": "number", "exclusiveMinimum": 0, "maximum": 50.5},
    },
    "required": ["kind", "owner", "tags", "id", "weight"],
}
TOOLS = [
    (
        "get_weather",
        {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    ),
    (
        "add",
        {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]},
    ),
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(resolve_model("smollm2")[0])


@pytest.fixture(scope="module")
def gt(tok):
    return grammar_tokenizer(tok)


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(1, thread_name_prefix="grammar") as ex:
        yield ex


def generate(tok, matcher: Matcher, seed: int, steps: int = 300) -> list[int]:
    """Random logits (a model that knows nothing) through the grammar until end of sequence."""
    rng, ids = np.random.default_rng(seed), []
    for _ in range(steps):
        logits = rng.standard_normal(tok.vocab_size).astype(np.float32)
        for eos in tok.eos_token_ids:
            logits[eos] += 4.0  # a model that wants to stop: the grammar allows it only when the text is complete
        token = int(np.argmax(matcher.apply(logits)))
        matcher.advance(token)
        ids.append(token)
        if token in tok.eos_token_ids:
            return ids
    raise AssertionError(f"no end of sequence in {steps} tokens: {tok.decode(ids)!r}")


@pytest.mark.parametrize("seed", range(4))
def test_random_logits_always_give_json_valid_against_the_schema(tok, gt, pool, seed):
    ids = generate(tok, Matcher(gt, Constraint(json_schema_grammar(SCHEMA)), pool), seed)
    jsonschema.validate(json.loads(tok.decode(ids)), closed_objects(SCHEMA))


def test_json_object_accepts_any_object_and_nothing_else(tok, gt):
    good = Matcher(gt, Constraint(json_object_grammar(), tuple(tok.encode('{"x":[1,{"y":null}]}', False))))
    assert good.stopped  # the object is complete: only the end may follow
    with pytest.raises(GrammarError, match="replayed tokens"):
        Matcher(gt, Constraint(json_object_grammar(), tuple(tok.encode("[1,2]", False))))


def test_extra_properties_are_closed_unless_the_schema_asks_for_them():
    closed = closed_objects(
        {
            "type": "object",
            "properties": {"a": {"type": "object", "properties": {}}},
            "$defs": {"d": {"properties": {"b": {}}, "additionalProperties": True}},
        }
    )
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is True


def accepts(tok, gt, grammar: str, text: str) -> bool:
    try:
        m = Matcher(gt, Constraint(grammar, tuple(tok.encode(text, False))))
        eos = min(tok.eos_token_ids)
        return bool(m.apply(np.zeros(tok.vocab_size, np.float32))[eos] == 0)  # the end is allowed here
    except GrammarError:
        return False


CALL = '<tool_call>\n{"name":"add","arguments":{"x":1,"y":2}}\n</tool_call>'


def test_auto_tool_grammar_leaves_text_free_and_enforces_calls_once_started(tok, gt):
    auto = tool_call_grammar(TOOLS, required=False, parallel=True)
    assert accepts(tok, gt, auto, "Sure, <b>let</b> me check. <tool_cal")  # text, partial triggers included
    assert accepts(tok, gt, auto, "Hi " + CALL)
    assert accepts(tok, gt, auto, "Hi " + CALL + "\n" + CALL)  # parallel calls
    assert not accepts(tok, gt, auto, "Hi " + CALL + " and more text")
    assert not accepts(tok, gt, auto, "Hi <tool_call> free text")
    assert not accepts(tok, gt, auto, '<tool_call>\n{"name":"mul","arguments":{}}\n</tool_call>')
    assert not accepts(tok, gt, auto, '<tool_call>\n{"name":"get_weather","arguments":{"unit":"c"}}\n</tool_call>')


def test_required_tool_grammar_allows_only_calls(tok, gt, pool):
    single = tool_call_grammar(TOOLS, required=True, parallel=False)
    assert not accepts(tok, gt, single, "Sure")
    assert not accepts(tok, gt, single, CALL + "\n" + CALL)
    for seed in range(3):
        text = tok.decode(generate(tok, Matcher(gt, Constraint(single), pool), seed))
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
        call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
        params = dict(TOOLS)[call["name"]]
        jsonschema.validate(call["arguments"], closed_objects(params))


def test_a_replayed_matcher_continues_exactly_where_the_first_was(tok, gt, pool):
    grammar = json_schema_grammar(SCHEMA)
    first = Matcher(gt, Constraint(grammar), pool)
    ids = generate(tok, first, seed=7)
    for cut in (1, len(ids) // 2, len(ids) - 1):
        original = Matcher(gt, Constraint(grammar), pool)
        for t in ids[:cut]:
            original.mask()
            original.advance(t)
        replayed = Matcher(gt, Constraint(grammar, tuple(ids[:cut])), pool)
        assert np.array_equal(replayed.mask(), original.mask())


def test_bad_schemas_are_refused_with_the_reason(gt):
    with pytest.raises(GrammarError, match="Unknown format"):
        gt.check(json_schema_grammar({"type": "string", "format": "not-a-format"}))
    with pytest.raises(GrammarError, match="JSON schema must be an object"):
        json_schema_grammar([1, 2])  # type: ignore[arg-type]
    with pytest.raises(GrammarError):
        gt.check(json_schema_grammar({"type": "object", "properties": {"a": {"type": "strin"}}}))


def test_hostile_grammars_are_bounded(tok, gt, pool):
    with pytest.raises(GrammarError, match="exceeds"):
        Constraint(json_schema_grammar({"enum": [f"value-{i}" for i in range(30_000)]}))
    # a regex whose DFA would have 2^40 states: llguidance builds its lexer lazily, so it runs in bounded steps
    pattern = "^(a|b)*a(a|b){12}$"
    grammar = json_schema_grammar({"type": "string", "pattern": pattern})
    gt.check(grammar)
    text = json.loads(tok.decode(generate(tok, Matcher(gt, Constraint(grammar), pool), seed=1)))
    jsonschema.validate(text, {"type": "string", "pattern": pattern})


def test_tool_parameters_with_defs_and_refs_sample_valid_arguments(tok, gt, pool):
    """A tool's local pointers (`#/$defs/..`, `#/definitions/..`, `#`) resolve where its parameters sit in the
    call, so nested models as pydantic writes them constrain the arguments."""
    leaf = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}
    nested = {
        "type": "object",
        "$defs": {"Leaf": leaf},
        "properties": {
            "leaf": {"$ref": "#/$defs/Leaf"},
            "leaves": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/Leaf"}},
        },
        "required": ["leaf", "leaves"],
    }
    draft7 = {
        "type": "object",
        "definitions": {"N": {"enum": [1, 2]}},
        "properties": {"n": {"$ref": "#/definitions/N"}},
    }
    tools = [("nested", nested), ("draft7", draft7)]
    grammar = tool_call_grammar(tools, required=True, parallel=False)
    gt.check(grammar)
    for seed in range(4):
        text = tok.decode(generate(tok, Matcher(gt, Constraint(grammar), pool), seed))
        call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
        jsonschema.validate(call["arguments"], closed_objects(dict(tools)[call["name"]]))
    assert relocated_refs({"$ref": "#", "const": {"$ref": "#/x"}}, "#/a") == {"$ref": "#/a", "const": {"$ref": "#/x"}}


def test_one_of_with_a_const_discriminator_is_used_and_an_overlapping_one_is_refused_naming_it(tok, gt, pool):
    cat = {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"enum": [1, 9]}}, "required": ["kind"]}
    dog = {
        "type": "object",
        "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
        "required": ["kind"],
    }
    schema = {"type": "object", "properties": {"pet": {"oneOf": [cat, dog]}}, "required": ["pet"]}
    grammar = json_schema_grammar(schema)
    gt.check(grammar)
    for seed in range(3):
        jsonschema.validate(json.loads(tok.decode(generate(tok, Matcher(gt, Constraint(grammar), pool), seed))), schema)
    tools = tool_call_grammar([("adopt", schema)], required=True, parallel=False)
    gt.check(tools)
    with pytest.raises(GrammarError, match="oneOf"):
        gt.check(json_schema_grammar({"oneOf": [{"type": "integer"}, {"type": "number"}]}))


def test_tools_with_a_response_format_give_calls_or_json_of_the_schema(tok, gt, pool):
    reply = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    grammar = tool_call_grammar(TOOLS, required=False, parallel=True, reply_schema=reply)
    assert accepts(tok, gt, grammar, '{"answer":"no"}') and accepts(tok, gt, grammar, CALL)
    assert not accepts(tok, gt, grammar, "Sure") and not accepts(tok, gt, grammar, '{"answer":"maybe"}')
    for seed in range(4):
        text = tok.decode(generate(tok, Matcher(gt, Constraint(grammar), pool), seed))
        if not text.startswith("<tool_call>"):
            jsonschema.validate(json.loads(text), reply)


@pytest.mark.parametrize(
    "branches",
    [
        [
            {"required": ["k"], "properties": {"k": {"const": 1}}},
            {"required": ["k"], "properties": {"k": {"const": 2}}},
        ],
        [{"type": "object", "required": [{}], "properties": []}, {"type": "object", "required": "k"}],
        [
            {"type": "object", "required": ["k"], "properties": {"k": {"const": None}}},
            {"type": "object", "required": ["k"], "properties": {"k": {"const": None}}},
        ],
    ],
)
def test_a_one_of_not_provably_exclusive_stays_one_of(branches):
    """Without `type: object` a branch also takes strings, numbers..: both would; equal tags overlap; malformed
    branches are llguidance's to refuse."""
    assert discriminated_one_of({"oneOf": branches}) == {"oneOf": branches}
