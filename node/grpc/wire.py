"""Conversions between the protobuf wire messages and the node's dataclasses / numpy arrays.

Everything decoded here came from the network and is hostile until validated: every decoder either returns a
fully validated value or raises `WireError` (the gRPC server maps it to INVALID_ARGUMENT). Encoders take values
that were validated when they were built, so they only check what the wire format itself cannot carry.

This module holds the messages of a request (tensors, specs, results, activations), a spec's sampling parameters
being node/grpc/wire_sampling.py's; what nodes say about themselves and the weights they share, outside any request,
is node/grpc/wire_cluster.py. All are built on the limits and checks of node/grpc/wire_base.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from node.core.failures import MAX_DETAIL, Failure, FailureKind
from node.core.plan import MAX_REQUEST_ID, REQUEST_ID, PlanStep, RequestSpec
from node.core.requests import Activation, Refusal, TokenMessage
from node.grpc.generated import node_service_pb2 as pb
from node.grpc.wire_base import (
    FINISH_REASONS,
    MAX_DIMS,
    MAX_MESSAGES,
    MAX_MODEL_ID,
    MAX_PLAN_STEPS,
    MAX_STOP_IDS,
    MAX_TOKENS_PER_MESSAGE,
    WireError,
    _count,
    _f32,
    _text,
)
from node.grpc.wire_sampling import decode_sampling, encode_sampling
from shards.decoding.sampling import MAX_TOP_LOGPROBS, SampleResult
from shards.model.shard import Shard

# The allow-list: wire name -> little-endian dtype. The names are exact ("<f4", "float64", "" are rejected).
_DTYPES: dict[str, np.dtype] = {"float32": np.dtype("<f4"), "int64": np.dtype("<i8")}


# --- tensors ---------------------------------------------------------------------------------------------


def encode_tensor(a: np.ndarray) -> pb.Tensor:
    if not isinstance(a, np.ndarray):
        raise WireError(f"expected a numpy array, got {type(a).__name__}")
    name = next((n for n, dt in _DTYPES.items() if a.dtype.kind == dt.kind and a.dtype.itemsize == dt.itemsize), None)
    if name is None:
        raise WireError(f"dtype {a.dtype} cannot travel; allowed: {', '.join(_DTYPES)}")
    if not 1 <= a.ndim <= MAX_DIMS:
        raise WireError(f"tensors have 1 to {MAX_DIMS} dims, got {a.ndim}")
    # astype to the little-endian dtype byte-swaps big-endian input; tobytes("C") handles any memory layout.
    data = a.astype(_DTYPES[name], copy=False).tobytes(order="C")
    return pb.Tensor(data=data, shape=a.shape, dtype=name)


def decode_tensor(t: pb.Tensor, max_bytes: int) -> np.ndarray:
    """A read-only array viewing the message bytes (no copy); callers that write into it must copy it."""
    dt = _DTYPES.get(t.dtype)
    if dt is None:
        raise WireError(f"tensor dtype {t.dtype[:32]!r} is not one of {', '.join(_DTYPES)}")
    return tensor_of(t.data, dt, tuple(int(d) for d in t.shape), max_bytes)


def tensor_of(data: bytes | memoryview, dt: np.dtype, shape: tuple[int, ...], max_bytes: int) -> np.ndarray:
    """`decode_tensor`'s checks and array over bytes already taken out of a message (node/grpc/link/packed.py's
    too): a read-only view of `data`."""
    if not 1 <= len(shape) <= MAX_DIMS:
        raise WireError(f"tensors have 1 to {MAX_DIMS} dims, got {len(shape)}")
    if any(d < 0 for d in shape):
        raise WireError(f"tensor shape {shape} has a negative dim")
    if len(data) > max_bytes:
        raise WireError(f"tensor of {len(data)} bytes exceeds the limit of {max_bytes}")
    # Python ints: no overflow, so [2**62, 2**62] cannot wrap around to a small size.
    if (need := math.prod(shape) * dt.itemsize) != len(data):
        raise WireError(f"tensor shape {shape} of {dt} needs {need} bytes, got {len(data)}")
    # An empty tensor matches any other dims ([0, 2**62] holds 0 bytes), but numpy refuses such shapes and no
    # legitimate tensor has them: the non-zero dims must fit the byte budget as well.
    if math.prod(max(d, 1) for d in shape) * dt.itemsize > max_bytes:
        raise WireError(f"tensor shape {shape} exceeds the limit of {max_bytes} bytes")
    # On a big-endian host astype converts to native order; on little-endian hosts it is a no-op view.
    a = np.frombuffer(data, dtype=dt).astype(dt.newbyteorder("="), copy=False).reshape(shape)
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        raise WireError("float tensor holds NaN or infinity")
    return a


# --- shards, sampling, request specs ---------------------------------------------------------------------


def encode_shard(s: Shard) -> pb.ShardRange:
    return pb.ShardRange(model_id=s.model_id, start_layer=s.start_layer, end_layer=s.end_layer, n_layers=s.n_layers)


def decode_shard(m: pb.ShardRange) -> Shard:
    model_id = _text(m.model_id, "shard model_id", MAX_MODEL_ID)
    try:
        return Shard(model_id, m.start_layer, m.end_layer, m.n_layers)
    except ValueError as e:
        raise WireError(str(e)) from e


def encode_spec(s: RequestSpec) -> pb.RequestSpec:
    return pb.RequestSpec(
        request_id=s.request_id,
        plan=[pb.PlanStep(node_id=p.node_id, address=p.address, shard=encode_shard(p.shard)) for p in s.plan],
        sampling=encode_sampling(s.sampling),
        max_tokens=s.max_tokens,
        stop_token_ids=sorted(s.stop_token_ids),  # sorted: the same spec always encodes to the same bytes
        entry_node_id=s.entry_node_id,
        entry_address=s.entry_address,
        resumed_tokens=s.resumed,
        prompt_tokens=s.prompt_tokens,
        reuse_from=s.reuse_from,
        reuse_positions=s.reuse_positions,
    )


def decode_spec(m: pb.RequestSpec) -> RequestSpec:
    # Caps first, so an oversized message is rejected before any per-item work.
    _count(m.plan, "plan steps", MAX_PLAN_STEPS)
    _count(m.stop_token_ids, "stop token ids", MAX_STOP_IDS)
    if any(t < 0 for t in m.stop_token_ids):
        raise WireError("stop token ids must be >= 0")
    if not m.HasField("sampling"):
        raise WireError("request spec has no sampling parameters")
    plan = tuple(
        PlanStep(_text(p.node_id, "plan node_id"), _text(p.address, "plan address"), decode_shard(p.shard))
        for p in m.plan
    )
    sampling = decode_sampling(m.sampling)
    entry_node_id = _text(m.entry_node_id, "entry_node_id")
    entry_address = _text(m.entry_address, "entry_address")
    try:
        return RequestSpec(
            m.request_id,
            plan,
            sampling,
            m.max_tokens,
            frozenset(m.stop_token_ids),
            entry_node_id,
            entry_address,
            m.resumed_tokens,
            m.prompt_tokens,
            _text(m.reuse_from, "reuse_from") if m.reuse_from else "",
            m.reuse_positions,
        )
    # PlanError: a spec that is not a valid request (node/core/plan.py)
    except ValueError as e:
        raise WireError(f"invalid request spec: {e}") from e


# --- results ---------------------------------------------------------------------------------------------


def encode_result(r: SampleResult) -> pb.TokenResult:
    return pb.TokenResult(
        token=r.token,
        logprob=r.logprob,
        top_logprobs=[pb.TopLogprob(token=t, logprob=lp) for t, lp in r.top_logprobs],
    )


def checked_logprob(x: float) -> float:
    # Log-probabilities are <= 0; -inf (an underflowed probability) is tolerable, NaN and +inf are not.
    if math.isnan(x) or x == math.inf:
        raise WireError(f"invalid logprob {x}")
    return _f32(x)


def decode_result(m: pb.TokenResult) -> SampleResult:
    _count(m.top_logprobs, "top logprobs", MAX_TOP_LOGPROBS)
    top = [(t.token, t.logprob) for t in m.top_logprobs]
    return result_of(m.token, m.logprob if m.HasField("logprob") else None, top)


def result_of(token: int, logprob: float | None, top: Sequence[tuple[int, float]]) -> SampleResult:
    """`decode_result`'s checks over values already taken out of a message (node/grpc/link/packed.py's too)."""
    _count(top, "top logprobs", MAX_TOP_LOGPROBS)
    if token < 0 or any(t < 0 for t, _ in top):
        raise WireError("token ids must be >= 0")
    lp = None if logprob is None else checked_logprob(logprob)
    return SampleResult(token, lp, tuple((t, checked_logprob(x)) for t, x in top))


def encode_tokens(m: TokenMessage) -> pb.SendResultRequest:
    return pb.SendResultRequest(
        request_id=m.request_id,
        tokens=[encode_result(r) for r in m.results],
        finished=m.finished,
        finish_reason=m.finish_reason or "",
        failure=encode_failure(m.failure) if m.failure is not None else None,
    )


def decode_tokens(m: pb.SendResultRequest) -> TokenMessage:
    request_id = _text(m.request_id, "request_id", MAX_REQUEST_ID)
    results = tuple(decode_result(t) for t in _count(m.tokens, "tokens", MAX_TOKENS_PER_MESSAGE))
    failure = (lambda: decode_failure(m.failure)) if m.HasField("failure") else None
    return tokens_of(request_id, results, m.finished, m.finish_reason, failure)


def tokens_of(
    request_id: str,
    results: tuple[SampleResult, ...],
    finished: bool,
    finish_reason: str,
    failure: Callable[[], Failure] | None = None,
) -> TokenMessage:
    """`decode_tokens`'s checks over values already taken out of a message (node/grpc/link/packed.py's too);
    `failure`, where the message has one, decoded after them."""
    request_id = _text(request_id, "request_id", MAX_REQUEST_ID)
    _count(results, "tokens", MAX_TOKENS_PER_MESSAGE)
    if finish_reason not in FINISH_REASONS:
        raise WireError(f"unknown finish_reason {finish_reason[:32]!r}")
    if finish_reason and not finished:
        raise WireError("finish_reason given for an unfinished request")
    if (failure is not None) != (finish_reason == "error"):
        raise WireError("a failure comes exactly with finish_reason error")
    return TokenMessage(request_id, results, finished, finish_reason or None, failure() if failure else None)


# --- failures --------------------------------------------------------------------------------------------

_FAILURE_KINDS = {kind: pb.FailureKind.Value(f"FAILURE_KIND_{kind.name}") for kind in FailureKind}
_KIND_OF = {v: k for k, v in _FAILURE_KINDS.items()}


def encode_failure(f: Failure) -> pb.Failure:
    return pb.Failure(kind=_FAILURE_KINDS[f.kind], detail=f.detail, node=f.node)


def decode_failure(m: pb.Failure) -> Failure:
    if m.kind not in _KIND_OF:
        raise WireError(f"unknown failure kind {m.kind}")
    return Failure(
        _KIND_OF[m.kind], _text(m.detail, "failure detail", MAX_DETAIL), _text(m.node, "failure node", required=False)
    )


# --- activations -----------------------------------------------------------------------------------------


def encode_activation(a: Activation) -> pb.TensorEntry:
    entry = pb.TensorEntry(
        request_id=a.request_id, tensor=encode_tensor(a.data), partial=a.partial, proposals=a.proposals, start=a.start
    )
    if a.spec is not None:
        entry.spec.CopyFrom(encode_spec(a.spec))
    return entry


def decode_activation(m: pb.TensorEntry, max_bytes: int) -> Activation:
    """An activation; its proposals and start (speculative decoding) are checked for shape here: fewer proposals
    than rows, a start >= 0 with them (whether the start fits the request's cache is the core's and the engine's
    to say)."""
    _count(m.proposals, "proposals", MAX_TOKENS_PER_MESSAGE)
    return activation_of(
        m.request_id,
        lambda: decode_tensor(m.tensor, max_bytes),
        decode_spec(m.spec) if m.HasField("spec") else None,
        m.partial,
        tuple(int(t) for t in m.proposals),
        m.start if m.HasField("start") else None,
    )


def activation_of(
    request_id: str,
    tensor: Callable[[], np.ndarray],
    spec: RequestSpec | None,
    partial: bool,
    proposals: tuple[int, ...],
    start: int | None,
) -> Activation:
    """`decode_activation`'s checks over values already taken out of a message (node/grpc/link/packed.py's too),
    `tensor` decoded after them."""
    _count(proposals, "proposals", MAX_TOKENS_PER_MESSAGE)
    if any(t < 0 for t in proposals) or (start is not None and start < 0):
        raise WireError("proposals must be token ids >= 0 and start a cache position >= 0")
    try:
        return Activation(_text(request_id, "request_id", MAX_REQUEST_ID), tensor(), spec, partial, proposals, start)
    except ValueError as e:
        if isinstance(e, WireError):
            raise
        raise WireError(f"invalid activation: {e}") from e


def encode_refusal(r: Refusal) -> pb.Rejected:
    return pb.Rejected(request_id=r.request_id, failure=encode_failure(r.failure))


def decode_refusal(m: pb.Rejected) -> Refusal:
    if not m.HasField("failure"):
        raise WireError("a refusal must say why (failure)")
    return Refusal(_text(m.request_id, "request_id", MAX_REQUEST_ID), decode_failure(m.failure))


def encode_send(activations: tuple[Activation, ...], messages: tuple[TokenMessage, ...]) -> pb.SendRequest:
    return pb.SendRequest(
        entries=[encode_activation(a) for a in activations], results=[encode_tokens(m) for m in messages]
    )


def decode_send(m: pb.SendRequest, max_bytes: int) -> tuple[list[Activation], list[TokenMessage]]:
    _count(m.entries, "activations", MAX_MESSAGES)
    _count(m.results, "token messages", MAX_MESSAGES)
    return [decode_activation(e, max_bytes) for e in m.entries], [decode_tokens(r) for r in m.results]


def decode_branch(m: pb.EndRequestRequest) -> tuple[str, int] | None:
    """An EndRequest's branch (node/core/prefix_cache.py): a request id and a count of positions >= 1, or neither."""
    if not m.branch_of and not m.branch_at:
        return None
    if not m.branch_of or m.branch_at < 1:
        raise WireError("branch_of and branch_at go together (a request id and a count >= 1), or neither")
    if len(m.branch_of) > MAX_REQUEST_ID or not REQUEST_ID.match(m.branch_of):
        raise WireError(f"branch_of must be a request id: 1-{MAX_REQUEST_ID} characters of [A-Za-z0-9._:-]")
    return m.branch_of, int(m.branch_at)
