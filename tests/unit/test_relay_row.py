"""A ring's decode row's input taken the short way (node/grpc/link/packed.py `unpack_row`, `RequestBook.relay_row`,
`RelayInbox.hand`): where the engine thread waits for it and nothing but the checks applies, the core records it as
`relay_activations` would and the engine thread gets it; anywhere else nothing changes and the input goes the usual
way, which judges it as before.
"""

import threading
import time

import numpy as np

from node.core.node_core import NodeCore
from node.core.request_book import QUEUED, RELAYED
from node.core.requests import Activation
from node.runtime.relay import RelayInbox
from tests.support.factories import CFG, hidden, tokens
from tests.unit.test_relay import decoding, drafting_first_node


def state(core: NodeCore, rid: str = "r1") -> tuple:
    req = core.requests[rid]
    return req.positions_in, req.chunk_start, req.drafts, len(core.queue), dict(core.counters)


def test_the_short_way_records_what_relay_activations_records():
    short, usual = decoding(), decoding()
    for _ in range(3):
        data = hidden()
        assert short.relay_row("r1", data, "a") == RELAYED
        _, handed = usual.relay_activations([Activation("r1", data)], "a", awaited={"r1"})
        assert handed["r1"] is data
        assert state(short) == state(usual)
    assert short.requests["r1"].positions_in == 7 and short.counters["relayed_rows"] == 3


def test_without_a_caller_to_check_the_short_way_takes_the_row_as_the_usual_way_does():
    b = decoding()  # (no cluster key: no caller named)
    assert b.relay_row("r1", hidden(), None) == RELAYED and b.requests["r1"].positions_in == 5


def test_anything_but_a_plain_next_row_is_left_to_the_usual_way_with_nothing_changed():
    wide = np.zeros((1, CFG.hidden_size + 1), np.float32)
    cases = {
        "wrong sender": ("r1", hidden(), "c"),
        "wrong width": ("r1", wide, "a"),
        "tokens to a later shard": ("r1", tokens(3), "a"),
        "two rows": ("r1", hidden(2), "a"),
        "unknown request": ("r9", hidden(), "a"),
    }
    for why, (rid, data, caller) in cases.items():
        b = decoding()
        before = state(b)
        assert b.relay_row(rid, data, caller) is None, why
        assert state(b) == before, why
        refused, handed = b.relay_activations([Activation(rid, data)], caller, awaited={rid})
        assert handed == {} and len(refused) + len(b.queue) == 1, why  # the usual way refuses or queues it


def test_an_ended_request_and_one_past_its_declared_positions_are_left_to_the_usual_way():
    b = decoding()
    for _ in range(5):  # 4 prompt positions + 5 new declared
        assert b.relay_row("r1", hidden(), "a") == RELAYED
    before = state(b)
    assert b.relay_row("r1", hidden(), "a") is None and state(b) == before
    (refusal,), _ = b.relay_activations([Activation("r1", hidden())], "a", awaited={"r1"})
    assert "declared" in refusal.reason
    b.end_request("r1", "cancelled")
    assert b.relay_row("r1", hidden(), "a") is None


def test_a_first_nodes_token_is_relayed_unless_the_proposer_drafts_after_it_then_queued_as_the_usual_way_does():
    """Under prompt lookup (the default) the first node makes the proposals as each token comes back: a token after
    which it drafts nothing is relayed, one after which it drafts is queued with its drafts; either way the request's
    state is what `relay_activations` leaves."""

    short, usual = drafting_first_node(), drafting_first_node()
    for token, verdict in ((9, RELAYED), (5, RELAYED), (6, QUEUED)):  # (8, 9) and (9, 5) never seen; (5, 6) was
        assert short.relay_row("r1", tokens(token), "c") == verdict
        usual.relay_activations([Activation("r1", tokens(token))], "c", awaited={"r1"})
        assert state(short) == state(usual) and short.requests["r1"].history == usual.requests["r1"].history
    (queued,) = short.queue.queue
    assert queued.proposals == (7, 8) and queued.data.tolist() == [6, 7, 8]
    assert short.relay_row("r1", tokens(CFG.vocab_size), "c") is None  # a token outside the vocabulary


def waiting(inbox: RelayInbox, rows: list[str]) -> tuple[threading.Thread, list]:
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(inbox.wait(rows)))
    waiter.start()
    while not inbox._awaiting:
        time.sleep(0.001)
    return waiter, got


def test_the_inbox_hands_a_row_only_to_an_engine_thread_waiting_for_it_and_only_once_the_core_took_it():
    inbox = RelayInbox(lambda: True, wait_s=5)
    asked: list[str] = []
    assert not inbox.hand("r1", hidden(), lambda: asked.append("r1") or True)  # nobody waits: the core isn't asked
    waiter, got = waiting(inbox, ["r1", "r2"])
    assert not inbox.hand("r3", hidden(), lambda: asked.append("r3") or True)  # not one it waits for
    assert not inbox.hand("r1", hidden(), lambda: False)  # the core left it to the usual way
    data = hidden()
    assert inbox.hand("r1", data, lambda: asked.append("r1") or True)
    assert not inbox.hand("r1", hidden(), lambda: asked.append("again") or True)  # one input per row and pass
    assert inbox.hand("r2", hidden(), lambda: True)
    waiter.join(5)
    ((inputs, _),) = got
    assert asked == ["r1"] and inputs["r1"] is data and sorted(inputs) == ["r1", "r2"]


def test_asking_whether_the_short_way_would_take_a_row_answers_as_taking_it_does_and_changes_nothing():
    """`would_relay` is what a node waiting for its ring runs on the last input it took, to have the checks' code
    and data in its cache when the next comes (node/grpc/link/server.py `warm`): `relay_row`'s verdict, no effect."""
    wide = np.zeros((1, CFG.hidden_size + 1), np.float32)
    cases = [("r1", hidden(), "a"), ("r1", hidden(), None), ("r1", hidden(), "c"), ("r1", wide, "a")]
    cases += [("r1", tokens(3), "a"), ("r1", hidden(2), "a"), ("r9", hidden(), "a")]
    for rid, data, caller in cases:
        b = decoding()
        before = state(b)
        asked = b.would_relay(rid, data, caller)
        assert state(b) == before, (rid, caller)
        assert asked == (b.relay_row(rid, data, caller) is not None), (rid, caller)
    b = decoding()
    for _ in range(5):
        assert b.would_relay("r1", hidden(), "a") and b.relay_row("r1", hidden(), "a") == RELAYED
    assert not b.would_relay("r1", hidden(), "a")  # past the declared positions
    first = drafting_first_node()  # it would take a token after which it drafts, and drafts nothing when asked
    before, history = state(first), list(first.requests["r1"].history)
    assert first.would_relay("r1", tokens(6), "c")
    assert state(first) == before and first.requests["r1"].history == history
