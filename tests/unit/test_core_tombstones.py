"""A request that failed at a node stays failed there: a late activation for it is refused with the failure, so the
node that sent it fails the request too and its entry hears at once, where a request that ended normally drops late
activations silently (tests/unit/test_core.py).

The case it comes from: a last node that could not reach a frozen entry ends the request. The entry wakes, takes
the token that did arrive, and its first node sends the next input; dropped silently, the entry would wait for its
idle timeout (tests/cluster/test_big_bodies.py's frozen entry waited 60 s)."""

from node.core.actions import Deliver, Release
from node.core.failures import Failure, FailureKind
from node.core.requests import Activation, TokenMessage, Tombstones
from shards.decoding.sampling import SampleResult
from tests.support.factories import hidden, spec
from tests.unit.test_core import core, of


def test_a_late_activation_for_a_request_that_failed_here_is_refused_with_its_failure():
    c = core("c")
    c.accept_activations([Activation("r1", hidden(), spec())])
    c.deliver_failed("h:9", TokenMessage("r1", (SampleResult(1),)), "unavailable: channel closed")
    (refusal,) = c.accept_activations([Activation("r1", hidden(), spec())])
    assert refusal.failure.kind is FailureKind.LOST and "could not reach the entry" in refusal.reason
    assert not c.requests, "a refused late activation revived the request"


def test_the_sender_of_the_refused_activation_fails_the_request_and_its_entry_may_replay():
    b, c = core("b"), core("c")
    b.accept_activations([Activation("r1", hidden(), spec())])
    c.accept_activations([Activation("r1", hidden(), spec())])
    c.fail("r1", "sending to h:9 failed: closed", retryable=True)
    refused = c.accept_activations([Activation("r1", hidden(), spec())])
    actions = b.refused("h:3", refused)
    (told,) = of(Deliver, actions)
    assert Release("r1") in actions and told.message.failure.kind is FailureKind.LOST
    assert "sending to h:9 failed" in told.message.error


def test_a_failure_outlasts_a_later_end_of_the_same_request():
    """The entry ends a failed request everywhere ("failed"): the node keeps the failure it saw."""
    c = core("c")
    c.accept_activations([Activation("r1", hidden(), spec())])
    c.fail("r1", "the engine failed")
    c.end_request("r1", "failed")
    assert c.ended.failure("r1").kind is FailureKind.ERROR
    assert c.accept_activations([Activation("r1", hidden(), spec())])[0].failure.kind is FailureKind.ERROR


def test_tombstones_keep_failures_within_their_bound():
    t, lost = Tombstones(size=2), Failure(FailureKind.LOST, "gone", "c")
    t.add("r0", lost)
    t.add("r1")
    assert (t.failure("r0"), t.failure("r1")) == (lost, None)
    t.add("r2")
    assert "r0" not in t and t.failure("r0") is None
