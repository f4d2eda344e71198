"""A model's own sampling defaults (shards/formats/sampling_defaults.py): read from generation_config.json or a GGUF's
general.sampling.* keys, hostile values left out with a warning, and applied by the API to the fields a request left
out, whatever its dialect: a request's own value always stands, and Ollama's defaults give way to the model's as
they give way to a Modelfile's parameters."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

import gguf
import pytest

from node.http import ollama
from node.http.api import Api, ApiSettings
from node.http.schema import parse_chat
from shards.decoding.penalties import MAX_PENALTY_WINDOW
from shards.decoding.sampling import SamplingParams
from shards.formats.sampling_defaults import SamplingDefaults, SamplingDefaultsError, model_sampling
from tests.unit.test_node_rpc import serving, shutdown

QWEN3 = SamplingDefaults(temperature=0.6, top_k=20, top_p=0.95, min_p=0.0)  # its generation_config.json's
ASK = [{"role": "user", "content": "hi"}]


def write_gguf(path, floats=None, ints=None, strings=None):
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (floats or {}).items():
        w.add_float32(f"general.sampling.{key}", value)
    for key, value in (ints or {}).items():
        w.add_int32(f"general.sampling.{key}", value)
    for key, value in (strings or {}).items():
        w.add_string(f"general.sampling.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_folder_recommends_its_sampling_in_generation_config(tmp_path):
    config = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0, "do_sample": True, "eos_token_id": 2}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert model_sampling(tmp_path, None) == QWEN3
    assert model_sampling(tmp_path / "nothing here", None) == SamplingDefaults()


def test_a_gguf_recommends_its_sampling_in_its_general_sampling_keys(tmp_path):
    write_gguf(
        tmp_path / "m.gguf",
        floats={"temp": 0.6, "top_p": 0.95, "min_p": 0.05, "penalty_repeat": 1.1},
        ints={"top_k": 20, "penalty_last_n": -1},  # llama.cpp's -1: the whole context
    )
    assert model_sampling(tmp_path, tmp_path / "m.gguf") == SamplingDefaults(
        0.6, 20, 0.95, 0.05, 1.1, MAX_PENALTY_WINDOW
    )


def test_a_value_of_the_wrong_type_or_out_of_range_is_left_out_with_a_warning(tmp_path, caplog):
    write_gguf(
        tmp_path / "m.gguf", floats={"temp": float("nan"), "top_k": 20.0}, ints={"top_p": 1}, strings={"min_p": "x"}
    )
    with caplog.at_level(logging.WARNING):
        assert model_sampling(tmp_path, tmp_path / "m.gguf") == SamplingDefaults(top_p=1.0)  # an integer is a number
    warned = caplog.text
    assert all(k in warned for k in ("general.sampling.temp", "general.sampling.top_k", "general.sampling.min_p"))
    caplog.clear()
    bad = {"temperature": 5, "top_k": -3, "top_p": "0.9", "repetition_penalty": 1.2}
    (tmp_path / "generation_config.json").write_text(json.dumps(bad))
    with caplog.at_level(logging.WARNING):
        assert model_sampling(tmp_path, None) == SamplingDefaults(repetition_penalty=1.2)
    assert all(k in caplog.text for k in ("temperature", "top_k", "top_p"))
    with pytest.raises(SamplingDefaultsError):
        SamplingDefaults(penalty_last_n=MAX_PENALTY_WINDOW + 1)


def test_only_the_fields_a_request_left_out_take_the_models_values():
    asked = SamplingParams(temperature=1.0, top_p=0.5, seed=3)
    filled = QWEN3.fill(asked, frozenset({"top_p"}))
    assert (filled.temperature, filled.top_k, filled.top_p, filled.min_p, filled.seed) == (0.6, 20, 0.5, 0.0, 3)
    assert SamplingDefaults().fill(asked, frozenset()) is asked


@pytest.mark.parametrize(
    "parse, body, expected",
    [
        (parse_chat, {"model": "llama", "messages": ASK}, (0.6, 20, 0.95)),  # OpenAI: nothing named
        (parse_chat, {"model": "llama", "messages": ASK, "temperature": 1.0, "top_k": 0}, (1.0, 0, 0.95)),
        (lambda b: ollama.parse_chat(b)[0], {"model": "llama", "messages": ASK}, (0.6, 20, 0.95)),  # not Ollama's
        (
            lambda b: ollama.parse_chat(b)[0],
            {"model": "llama", "messages": ASK, "options": {"top_p": 0.5}},
            (0.6, 20, 0.5),
        ),
    ],
)
def test_the_api_samples_with_the_models_defaults_where_the_request_named_none(parse, body, expected):
    async def go():
        node, server, peer = await serving()
        node.model = dataclasses.replace(node.model, sampling=QWEN3)
        try:
            req = parse(body)
            job = Api(node, ApiSettings())._job(req.options, [1, 2, 3], "messages")
            return job.sampling
        finally:
            await shutdown(node, server, peer)

    s = asyncio.run(go())
    assert (s.temperature, s.top_k, s.top_p) == expected
