"""The wire format of what a request asks for: shard ranges, sampling parameters and request specs survive a
round trip, and a malformed one from the network is a WireError (node/grpc/wire.py)."""

from __future__ import annotations

import pytest

from node.core.plan import PlanStep, RequestSpec
from node.grpc.generated import node_service_pb2 as pb
from node.grpc.wire import (
    MAX_PLAN_STEPS,
    MAX_STOP_IDS,
    WireError,
    decode_sampling,
    decode_shard,
    decode_spec,
    encode_sampling,
    encode_shard,
    encode_spec,
)
from shards.decoding.sampling import SamplingParams
from shards.model.shard import Shard


def make_spec(**overrides) -> RequestSpec:
    fields = dict(
        request_id="req-1",
        plan=(
            PlanStep("a", "10.0.0.1:5000", Shard("m", 0, 10, 16)),
            PlanStep("b", "[::1]:5001", Shard("m", 10, 16, 16)),
        ),
        sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=2**64 - 1, top_logprobs=5),
        max_tokens=128,
        stop_token_ids=frozenset({2, 0, 151645}),
        entry_node_id="a",
        entry_address="10.0.0.1:5000",
    )
    return RequestSpec(**{**fields, **overrides})


# --- shards and sampling ---------------------------------------------------------------------------------


def test_shard_round_trip():
    s = Shard("Qwen/Qwen3-0.6B", 3, 28, 28)
    assert decode_shard(encode_shard(s)) == s


@pytest.mark.parametrize(
    "m",
    [
        pb.ShardRange(model_id="", start_layer=0, end_layer=1, n_layers=1),
        pb.ShardRange(model_id="m" * 257, start_layer=0, end_layer=1, n_layers=1),
        pb.ShardRange(model_id="m", start_layer=2, end_layer=2, n_layers=4),
        pb.ShardRange(model_id="m", start_layer=-1, end_layer=2, n_layers=4),
        pb.ShardRange(model_id="m", start_layer=0, end_layer=5, n_layers=4),
        pb.ShardRange(),
    ],
)
def test_invalid_shards_are_rejected(m):
    with pytest.raises(WireError):
        decode_shard(m)


@pytest.mark.parametrize(
    "p",
    [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.95, top_k=50, seed=0, top_logprobs=0),
        SamplingParams(temperature=1.3, top_p=0.1, seed=2**64 - 1, top_logprobs=20),
        SamplingParams(temperature=1e-7, top_p=1e-7),  # tiny values stay tiny (not rounded to 0)
    ],
)
def test_sampling_round_trip_is_exact_for_typical_values(p):
    assert decode_sampling(encode_sampling(p)) == p


def test_sampling_presence_of_optional_fields():
    m = encode_sampling(SamplingParams(seed=None, top_logprobs=None))
    assert not m.HasField("seed") and not m.HasField("top_logprobs")
    m = encode_sampling(SamplingParams(seed=0, top_logprobs=0))  # zero is present, not absent
    assert m.HasField("seed") and m.HasField("top_logprobs")
    assert decode_sampling(m).seed == 0 and decode_sampling(m).top_logprobs == 0


@pytest.mark.parametrize(
    "m",
    [
        pb.Sampling(temperature=1, top_p=0),
        pb.Sampling(temperature=-1, top_p=1),
        pb.Sampling(temperature=float("nan"), top_p=1),
        pb.Sampling(temperature=float("inf"), top_p=1),
        pb.Sampling(temperature=1, top_p=1.5),
        pb.Sampling(temperature=1, top_p=float("nan")),
        pb.Sampling(temperature=1, top_p=1, top_k=-1),
        pb.Sampling(temperature=1, top_p=1, top_logprobs=21),
        pb.Sampling(temperature=1, top_p=1, top_logprobs=-1),
        pb.Sampling(),  # all defaults: top_p 0 is invalid, so a missing message cannot pass as greedy
    ],
)
def test_invalid_sampling_is_rejected(m):
    with pytest.raises(WireError, match="invalid sampling"):
        decode_sampling(m)


def test_encode_sampling_rejects_a_seed_wider_than_64_bits():
    with pytest.raises(WireError, match="64 bits"):
        encode_sampling(SamplingParams(seed=2**64))


# --- request specs ---------------------------------------------------------------------------------------


def test_spec_round_trip():
    s = make_spec()
    assert decode_spec(encode_spec(s)) == s
    assert decode_spec(pb.RequestSpec.FromString(encode_spec(s).SerializeToString())) == s


def test_spec_encoding_is_deterministic():
    assert list(encode_spec(make_spec()).stop_token_ids) == [0, 2, 151645]


def spec_msg() -> pb.RequestSpec:
    return encode_spec(make_spec())


def _empty_plan(m):
    del m.plan[:]


def _gap(m):
    m.plan[1].shard.start_layer = 11


def _overlap(m):
    m.plan[1].shard.start_layer = 9


def _mixed_models(m):
    m.plan[1].shard.model_id = "other"


def _mixed_layer_counts(m):
    m.plan[1].shard.n_layers = 17
    m.plan[1].shard.end_layer = 17


def _short(m):
    m.plan[1].shard.end_layer = 15


def _bad_address(m):
    m.plan[1].address = "no-port"


def _bad_port(m):
    m.plan[0].address = "host:70000"


def _superscript_port(m):
    m.plan[0].address = "host:1²"  # "²".isdigit() is True but int() refuses it


def _bad_entry_address(m):
    m.entry_address = "host:"


def _duplicate_node(m):
    m.plan[1].node_id = "a"


def _empty_node(m):
    m.plan[1].node_id = ""


def _no_shard(m):
    m.plan[1].ClearField("shard")


def _bad_request_id(m):
    m.request_id = "has space"


def _empty_request_id(m):
    m.request_id = ""


def _long_request_id(m):
    m.request_id = "r" * 129


def _max_tokens_0(m):
    m.max_tokens = 0


def _max_tokens_negative(m):
    m.max_tokens = -5


def _negative_stop_id(m):
    m.stop_token_ids.append(-1)


def _too_many_stop_ids(m):
    m.stop_token_ids.extend(range(MAX_STOP_IDS + 1))


def _too_many_steps(m):
    m.plan.extend([m.plan[0]] * MAX_PLAN_STEPS)


def _no_sampling(m):
    m.ClearField("sampling")


def _top_p_0(m):
    m.sampling.top_p = 0


def _temperature_negative(m):
    m.sampling.temperature = -1


def _no_entry_node(m):
    m.entry_node_id = ""


@pytest.mark.parametrize(
    "mutate",
    [
        _empty_plan,
        _gap,
        _overlap,
        _mixed_models,
        _mixed_layer_counts,
        _short,
        _bad_address,
        _bad_port,
        _superscript_port,
        _bad_entry_address,
        _duplicate_node,
        _empty_node,
        _no_shard,
        _bad_request_id,
        _empty_request_id,
        _long_request_id,
        _max_tokens_0,
        _max_tokens_negative,
        _negative_stop_id,
        _too_many_stop_ids,
        _too_many_steps,
        _no_sampling,
        _top_p_0,
        _temperature_negative,
        _no_entry_node,
    ],
)
def test_invalid_specs_are_rejected(mutate):
    m = spec_msg()
    mutate(m)
    with pytest.raises(WireError):
        decode_spec(m)
