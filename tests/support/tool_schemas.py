"""What the tools and structured-output cluster tests share (tests/cluster/test_api_tools.py,
test_api_structured.py): the packaged SmolLM2's id, the tools and schemas they ask for, and the mark that keeps a
test on the one-node cluster (tests/cluster/conftest.py's `smollm2_client`)."""

from __future__ import annotations

import pytest

MODEL = "smollm2-135m-instruct"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The current weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "number", "minimum": -1000, "maximum": 1000},
                    "b": {"type": "number", "minimum": -1000, "maximum": 1000},
                },
                "required": ["a", "b"],
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# Every kind of constraint the issue names; bounded so that any sampled text ends within max_tokens.
SCHEMAS = {
    "enum_and_bounds": {
        "type": "object",
        "required": ["mood", "score", "ratio"],
        "properties": {
            "mood": {"enum": ["happy", "sad", "calm"]},
            "score": {"type": "integer", "minimum": 1, "maximum": 10},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
    },
    "nested_and_arrays": {
        "type": "object",
        "required": ["person", "tags"],
        "properties": {
            "person": {
                "type": "object",
                "required": ["name", "age"],
                "properties": {
                    "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
            },
            "tags": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string", "maxLength": 8}},
        },
    },
    "any_of_and_patterns": {
        "type": "object",
        "required": ["id", "code"],
        "properties": {
            "id": {
                "anyOf": [
                    {"type": "integer", "minimum": 1, "maximum": 999},
                    {"type": "string", "pattern": "^id-[0-9]{3}$"},
                ]
            },
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"},
        },
    },
}
SEEDS = range(3)
# What the entry alone decides (request parsing, templates, tool-call and JSON formatting, refusals) is the same on
# one node and on three: those tests run on the one-node cluster only. On three nodes the last node, another process,
# holds the grammar: the grammar crossing the wire and constraining sampling there is shown by the required tool
# call, the streamed tool-call deltas and the concurrent constrained requests (on one schema: the grammar travels
# the same way whatever it says; all three schemas run on one node).
ONE_NODE = pytest.mark.parametrize("smollm2_client", [1], ids=["1-node"], indirect=True)
THREE_NODES = pytest.mark.parametrize("smollm2_client", [3], ids=["3-nodes"], indirect=True)


def schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
