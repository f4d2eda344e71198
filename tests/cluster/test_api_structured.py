"""Structured output (JSON of a schema) through the official openai client, unmodified, on the packaged SmolLM2,
on one node and on three (tests/cluster/conftest.py): every sampled reply validates against its schema, beside free
requests and across the replay of a request whose sampling node died."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from pydantic import BaseModel, Field

from shards.decoding.grammar import closed_objects
from tests.support.cluster import Cluster
from tests.support.gguf_util import smollm2_path
from tests.support.http import stream_completion
from tests.support.tool_schemas import ASK, MODEL, ONE_NODE, SCHEMAS, SEEDS, THREE_NODES


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=100)


@ONE_NODE
def test_parse_with_a_pydantic_model(smollm2_client):
    r = smollm2_client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris."}],
        response_format=City,
        max_tokens=80,
        temperature=0,
    )
    assert isinstance(r.choices[0].message.parsed, City)


@ONE_NODE
@pytest.mark.parametrize("name", SCHEMAS)
def test_every_sampled_output_validates_with_concurrent_free_requests(smollm2_client, name):
    assert_every_sampled_output_validates(smollm2_client, name)


@THREE_NODES
def test_every_sampled_output_validates_with_concurrent_free_requests_on_three_nodes(smollm2_client):
    assert_every_sampled_output_validates(smollm2_client, "nested_and_arrays")


def assert_every_sampled_output_validates(smollm2_client, name: str) -> None:
    """Constrained requests beside free ones, at temperature 1: every output is valid JSON of the schema."""
    schema = SCHEMAS[name]

    def constrained(seed: int) -> str:
        r = smollm2_client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Give me an example record."}],
            max_tokens=120,
            temperature=1.0,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
        )
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content

    def free(seed: int) -> str:
        return (
            smollm2_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, seed=seed, temperature=1.0)
            .choices[0]
            .message.content
        )

    with ThreadPoolExecutor(6) as pool:
        frees = [pool.submit(free, s) for s in SEEDS]
        outputs = list(pool.map(constrained, SEEDS))
        assert all(isinstance(f.result(), str) for f in frees)
    for text in outputs:
        jsonschema.validate(json.loads(text), closed_objects(schema))


@ONE_NODE
def test_completions_take_a_json_response_format(smollm2_client):
    r = smollm2_client.completions.create(
        model=MODEL,
        prompt="A JSON object describing a cat:",
        max_tokens=60,
        temperature=0,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "cat", "schema": SCHEMAS["enum_and_bounds"]},
            }
        },
    )
    jsonschema.validate(json.loads(r.choices[0].text), closed_objects(SCHEMAS["enum_and_bounds"]))


def test_the_sampling_node_killed_mid_stream_the_replay_continues_the_grammar_exactly():
    """The last node (holding the request's matcher) dies; the entry replays on the two left, whose new last
    node feeds the generated tokens to a fresh matcher: the JSON is the undisturbed run's, and valid. (The numpy
    engine: a replay prefills the generated tokens, and only float32 makes prefill and decode agree bit for bit.)"""
    schema = {
        "type": "object",
        "required": ["values"],
        "properties": {
            "values": {
                "type": "array",
                "minItems": 8,
                "maxItems": 8,
                "items": {"type": "integer", "minimum": 0, "maximum": 999},
            }
        },
    }
    body = {
        "model": MODEL,
        "prompt": "Eight numbers as JSON:",
        "max_tokens": 60,
        "temperature": 0.8,
        "seed": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    }
    with Cluster(smollm2_path(), 3, memory_gb=[2, 2, 2], model_id=MODEL, engine="numpy") as c:
        url = f"{c.nodes[0].api_url}/v1/completions"
        reference = "".join(e.text for e in stream_completion(url, body))
        events = []
        for event in stream_completion(url, body):
            events.append(event)
            if len(events) == 8:
                c.nodes[2].proc.kill()
        assert [e.error for e in events if e.error] == []
        assert c.self_info()["node0"]["status"]["replays"] == 1
    text = "".join(e.text for e in events)
    assert text == reference
    jsonschema.validate(json.loads(text), schema)
