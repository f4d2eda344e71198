"""The sampling parameters on the wire (a request spec's, node/grpc/wire.py): decoded into `SamplingParams`,
whose own checks (ranges, the grammar's size, token ids) run on what the caps here let through, or `WireError`."""

from __future__ import annotations

from node.grpc.generated import node_service_pb2 as pb
from node.grpc.wire_base import _UINT64, MAX_GRAMMAR_PREFIX, WireError, _count, _f32
from shards.decoding.grammar import Constraint
from shards.decoding.penalties import DEFAULT_WINDOW, MAX_LOGIT_BIAS, MAX_PENALTY_WINDOW
from shards.decoding.sampling import SamplingParams


def encode_sampling(p: SamplingParams) -> pb.Sampling:
    if p.seed is not None and p.seed >= _UINT64:
        raise WireError(f"seed {p.seed} does not fit in 64 bits")
    c = p.constraint
    return pb.Sampling(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed,
        top_logprobs=p.top_logprobs,
        grammar=None if c is None else c.grammar,
        grammar_prefix=() if c is None else c.prefix,
        no_speculation=not p.speculate,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=None if p.repetition_penalty == 1 else p.repetition_penalty,
        penalty_last_n=None if p.penalty_last_n == DEFAULT_WINDOW else p.penalty_last_n,
        penalty_context=p.penalty_context,
        logit_bias=[pb.LogitBias(token=t, bias=b) for t, b in p.logit_bias],
    )


def decode_sampling(m: pb.Sampling) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=_f32(m.temperature),
            top_p=_f32(m.top_p),
            top_k=m.top_k,
            seed=m.seed if m.HasField("seed") else None,
            top_logprobs=m.top_logprobs if m.HasField("top_logprobs") else None,
            constraint=_constraint(m),
            speculate=not m.no_speculation,
            min_p=_f32(m.min_p),
            presence_penalty=_f32(m.presence_penalty),
            frequency_penalty=_f32(m.frequency_penalty),
            repetition_penalty=_f32(m.repetition_penalty) if m.HasField("repetition_penalty") else 1.0,
            penalty_last_n=m.penalty_last_n if m.HasField("penalty_last_n") else DEFAULT_WINDOW,
            penalty_context=_ids(m.penalty_context, "penalty context tokens", MAX_PENALTY_WINDOW),
            logit_bias=_logit_bias(m.logit_bias),
        )
    except ValueError as e:  # GrammarError included: an oversized grammar or a bad prefix
        raise WireError(f"invalid sampling: {e}") from e


def _ids(ids, what: str, most: int) -> tuple[int, ...]:
    _count(ids, what, most)
    return tuple(int(t) for t in ids)  # ids < 0 are refused by SamplingParams


def _logit_bias(entries) -> tuple[tuple[int, float], ...]:
    _count(entries, "logit bias entries", MAX_LOGIT_BIAS)
    return tuple((int(e.token), _f32(e.bias)) for e in entries)  # order and range: SamplingParams checks


def _constraint(m: pb.Sampling) -> Constraint | None:
    if not m.HasField("grammar"):
        if m.grammar_prefix:
            raise WireError("a grammar prefix without a grammar")
        return None
    _count(m.grammar_prefix, "grammar prefix tokens", MAX_GRAMMAR_PREFIX)
    return Constraint(m.grammar, tuple(m.grammar_prefix))  # checks the grammar's size and the ids
