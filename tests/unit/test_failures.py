"""The one failure type (node/core/failures.py): every layer says why a request failed with a `Failure` whose kind
is what the receiver may do, and the old ways of saying "busy" (admission's refusals, a peer's full upload slots)
now say it with that kind."""

import asyncio

import numpy as np
import pytest

from node.core.actions import Deliver
from node.core.admission import Admission, CoreLimits
from node.core.failures import MAX_DETAIL, Failed, Failure, FailureKind, busy, lost
from node.core.node_core import NodeCore
from node.core.requests import Activation, TokenMessage
from node.grpc.client import GrpcTransport
from node.runtime.transport import TransportError
from tests.support.factories import ADDR, CFG, hidden, spec
from tests.unit.test_fetch import Peer


def test_a_failure_says_where_it_happened_only_when_told():
    assert str(Failure(FailureKind.BUSY, "KV cache memory is full", "b")) == "node b: KV cache memory is full"
    assert str(Failure(FailureKind.LOST, "node c stopped answering")) == "node c stopped answering"


@pytest.mark.parametrize(
    "kind, detail, node",
    [("busy", "full", ""), (FailureKind.BUSY, "", ""), (FailureKind.ERROR, None, ""), (FailureKind.ERROR, "x", 7)],
)
def test_a_failure_without_a_known_kind_or_a_detail_is_refused_at_once(kind, detail, node):
    with pytest.raises(ValueError, match="kind must be one of|needs a detail|id or an address"):
        Failure(kind, detail, node)


def test_a_failure_report_never_fails_itself_however_long_the_text_it_carries():
    f = Failure(FailureKind.ERROR, "x" * (3 * MAX_DETAIL))
    assert len(f.detail) == MAX_DETAIL and f.detail.endswith("\u2026")


def test_only_busy_prefix_gone_and_lost_may_succeed_later():
    assert {k for k in FailureKind if Failure(k, "why").later} == {
        FailureKind.BUSY,
        FailureKind.PREFIX_GONE,
        FailureKind.LOST,
    }


def test_failed_carries_its_failure_and_says_it():
    e = busy("at its limit of 2 requests", "b")
    assert isinstance(e, Failed) and e.kind is FailureKind.BUSY and str(e) == "node b: at its limit of 2 requests"
    assert lost("stopped answering", "c").failure == Failure(FailureKind.LOST, "stopped answering", "c")


def test_a_token_message_carries_a_failure_exactly_when_it_ends_in_error():
    f = Failure(FailureKind.LOST, "forward failed", "b")
    assert TokenMessage("r1", finished=True, finish_reason="error", failure=f).error == "node b: forward failed"
    for bad in (
        dict(finished=True, finish_reason="error"),  # an error that says nothing
        dict(finished=True, finish_reason="stop", failure=f),  # a failure that isn't one
        dict(finish_reason="error", failure=f),  # an error that doesn't end the request
    ):
        with pytest.raises(ValueError, match="exactly when"):
            TokenMessage("r1", **bad)


def test_admission_refusing_for_lack_of_room_raises_a_busy_failure_naming_the_node():
    a = Admission("b", "llama", CFG, CoreLimits(max_requests=1), members=None, serves=lambda shard: True)
    held = {"r0": a.admit(spec("r0"), {}, now=0.0)}
    with pytest.raises(Failed) as refused:
        a.admit(spec("r1"), held, now=0.0)
    assert refused.value.failure == Failure(FailureKind.BUSY, "at its limit of 1 requests", "b")


def test_a_node_refusing_an_activation_for_lack_of_room_answers_a_busy_refusal_that_reaches_the_entry_as_busy():
    b = NodeCore("b", "llama", CFG, CoreLimits(max_requests=1))
    b.accept_activations([Activation("r0", hidden(), spec("r0"))])
    (refusal,) = b.accept_activations([Activation("r1", hidden(), spec("r1"))])
    assert refusal.failure.kind is FailureKind.BUSY and refusal.reason == "node b: at its limit of 1 requests"
    a = NodeCore("a", "llama", CFG, CoreLimits())
    a.accept_prompt(spec("r1"), np.arange(3))
    (told,) = [x for x in a.refused(ADDR["b"], [refusal]) if isinstance(x, Deliver)]
    assert told.address == ADDR["entry"] and told.message.failure.kind is FailureKind.BUSY
    assert "at its limit of 1 requests" in told.message.error


def test_a_peer_whose_upload_slots_are_full_is_busy_at_the_source_and_at_the_fetching_node():
    async def go():
        async with Peer(rate=4000, max_transfers=1) as peer:
            held = await peer.source.open("llama", 0)  # the only upload slot
            with pytest.raises(Failed) as at_source:
                await peer.source.open("llama", 1)
            transport = GrpcTransport()
            try:
                with pytest.raises(TransportError) as at_fetcher:
                    await transport.fetch_piece(peer.address, "llama", 1, 16384, idle_timeout=5)
            finally:
                held.close()
                await transport.close()
            return at_source.value, at_fetcher.value

    at_source, at_fetcher = asyncio.run(go())
    assert at_source.kind is FailureKind.BUSY and "upload slots are in use" in str(at_source)
    assert at_fetcher.kind is FailureKind.BUSY and at_fetcher.failure.node.startswith("127.0.0.1:")
    assert not at_fetcher.retryable  # busy, not lost: the fetcher waits for this peer instead of cooling it
