"""A request's grammar constraint on the wire: it reaches the sampling node intact, and a malformed one is refused
before any work (the gRPC server answers INVALID_ARGUMENT for a WireError)."""

from __future__ import annotations

import pytest

from node.grpc.generated import node_service_pb2 as pb
from node.grpc.wire import WireError, decode_sampling, encode_sampling
from shards.decoding.grammar import MAX_GRAMMAR_BYTES, Constraint, json_schema_grammar
from shards.decoding.sampling import SamplingParams

GRAMMAR = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}})


@pytest.mark.parametrize("constraint", [None, Constraint(GRAMMAR), Constraint(GRAMMAR, (90, 3, 0, 49151))])
def test_constraint_round_trips(constraint):
    p = SamplingParams(temperature=0.5, seed=3, constraint=constraint)
    assert decode_sampling(encode_sampling(p)) == p


def test_an_unconstrained_request_sends_no_grammar():
    assert not encode_sampling(SamplingParams()).HasField("grammar")


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda m: m.grammar_prefix.append(5), "prefix without a grammar"),
        (lambda m: setattr(m, "grammar", ""), "non-empty grammar"),
        (lambda m: setattr(m, "grammar", "x" * (MAX_GRAMMAR_BYTES + 1)), "exceeds"),
        (lambda m: (setattr(m, "grammar", GRAMMAR), m.grammar_prefix.append(-1)), "token ids >= 0"),
    ],
)
def test_malformed_constraints_are_refused(mutate, match):
    m = encode_sampling(SamplingParams())
    mutate(m)
    with pytest.raises(WireError, match=match):
        decode_sampling(pb.Sampling.FromString(m.SerializeToString()))
