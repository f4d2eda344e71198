"""Every schema the sampler can't follow is a 400 before any node works: a `$ref` that can never end and a pattern
whose lexer blows up are refused at admission (as response_format and as tool parameters), quickly and within
llguidance's limits; schemas people write still pass; a grammar that fails while sampling is counted."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import generate_latest

from node.http.api import Api
from node.runtime.metrics import NodeMetrics, NodeStatus
from node.runtime.sampling_batcher import SampleItem, SamplingBatcher
from shards.decoding.grammar import Constraint, GrammarError, grammar_tokenizer, json_schema_grammar
from shards.decoding.grammar_admission import admit, finite_definitions
from shards.decoding.sampling import SamplerState, SamplingParams
from shards.formats.packaged import resolve_model
from shards.formats.tokenizer import Tokenizer
from tests.unit.test_grammar import SCHEMA
from tests.unit.test_node_rpc import serving, shutdown
from tests.unit.test_sampling_batcher import LONG, Recording

CYCLE = {"type": "object", "properties": {"x": {"$ref": "#/$defs/A"}}, "required": ["x"]}
CYCLE["$defs"] = {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}
ENDLESS = {"$ref": "#/$defs/N", "$defs": {"N": {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"}}}}}
ENDLESS["$defs"]["N"]["required"] = ["next"]
BLOWUP = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a{1000}){1000}$"}}, "required": ["s"]}
HIDDEN_BLOWUP = {  # behind an optional property: the grammar's first steps never reach it
    "type": "object",
    "properties": {"n": {"type": "integer"}, "s": {"type": "string", "pattern": "^x(a{1000}){1000}$"}},
    "required": ["n"],
}
HIDDEN_CYCLE = {"$defs": {"A": {"$ref": "#/$defs/A"}}, "anyOf": [{"type": "integer"}, {"$ref": "#/$defs/A"}]}
LINKED_LIST = {
    "$ref": "#/$defs/Node",
    "$defs": {
        "Node": {
            "type": "object",
            "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}},
            "required": ["v", "next"],
        }
    },
}
TREE = {
    "$ref": "#/$defs/T",
    "$defs": {"T": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/T"}}}}},
}
TREE["$defs"]["T"]["required"] = ["kids"]
FORMATS = {
    "type": "object",
    "properties": {
        "when": {"type": "string", "format": "date-time"},
        "mail": {"type": "string", "format": "email"},
        "id": {"type": "string", "format": "uuid"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{4,6}(-[a-z]{3})?$"},
        "big": {"type": "string", "pattern": "^(ab){1,100}$"},
    },
    "required": ["when", "mail", "id", "code", "big"],
}
BAD = {"cycle": CYCLE, "endless": ENDLESS, "blowup": BLOWUP, "hidden blowup": HIDDEN_BLOWUP}
BAD["hidden cycle"] = HIDDEN_CYCLE


@pytest.fixture(scope="module")
def gt():
    return grammar_tokenizer(Tokenizer.load(resolve_model("smollm2")[0]))


@pytest.mark.parametrize("name", list(BAD))
def test_a_schema_the_sampler_cannot_follow_is_refused_at_admission(gt, name):
    with pytest.raises(GrammarError, match="never end|too complex"):
        admit(gt, json_schema_grammar(BAD[name]), [BAD[name]])


@pytest.mark.parametrize("schema", [SCHEMA, LINKED_LIST, TREE, FORMATS], ids=["nested", "list", "tree", "formats"])
def test_schemas_people_write_pass_admission_and_recursion_with_a_way_out_is_finite(gt, schema):
    admit(gt, json_schema_grammar(schema), [schema])
    finite_definitions(schema)


def test_the_refusal_names_the_definition_that_can_never_end():
    with pytest.raises(GrammarError, match="'#/\\$defs/N' can never end"):
        finite_definitions(ENDLESS)


def _chat(**extra) -> dict:
    return {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


def _as_response_format(schema):
    return _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})


def _as_tool(schema):
    return _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}], tool_choice="required")


def test_cycle_and_blowup_schemas_are_400s_within_100_ms_as_response_format_and_as_tool_parameters():
    async def go():
        node, server, peer = await serving()
        try:
            async with TestClient(TestServer(Api(node).app())) as client:
                await asyncio.to_thread(grammar_tokenizer, node.tokenizer)  # built once per model, at start-up
                for name in ("cycle", "blowup", "hidden blowup"):
                    for body in (_as_response_format(BAD[name]), _as_tool(BAD[name])):
                        cpu, wall = time.process_time(), time.perf_counter()
                        response = await client.post("/v1/chat/completions", json=body)
                        error = (await response.json())["error"]
                        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                        assert response.status == 400, (name, error)
                        assert error["code"] == "invalid_schema" and error["param"] in ("response_format", "tools")
                        # The bound is the request's own work (CPU of this process); the wall clock only catches a
                        # hang, as other jobs share this machine.
                        assert cpu < 0.1 and wall < 5, (name, cpu, wall)
                good = await client.post("/v1/chat/completions", json=_as_response_format(LINKED_LIST))
                assert good.status == 200, await good.text()
        finally:
            await shutdown(node, server, peer)

    asyncio.run(go())


def test_a_grammar_that_fails_while_sampling_is_counted_as_a_sampling_error():
    tok = Tokenizer.load(resolve_model("smollm2")[0])

    async def go():
        batcher = SamplingBatcher(8, LONG, grammar=lambda: grammar_tokenizer(tok))
        broken = Constraint(json_schema_grammar(ENDLESS))  # what admission refuses, sampled anyway
        rng = np.random.default_rng(0)
        failed, state = None, SamplerState.from_seed(1)
        for _ in range(4):
            row = rng.normal(0, 2, tok.vocab_size).astype(np.float32)
            item = SampleItem("r", row, SamplingParams(constraint=broken), state, Recording(), "m")
            future = batcher.submit(item)
            batcher.flush()
            try:
                await future
            except GrammarError as e:
                failed = e
                break
        await batcher.close()
        return batcher.stats, failed

    stats, failed = asyncio.run(go())
    assert failed is not None
    status = NodeStatus(0, 0, 0, 0, 0, 0, ended={}, sampling=stats)
    metrics = NodeMetrics(status=lambda: status, kv_cache_bytes=lambda: 0, name_of=str)
    text = generate_latest(metrics.registry).decode()
    assert "exo_sampling_errors_total 1.0" in text
    assert "exo_sampling_grammar_errors_total 1.0" in text
