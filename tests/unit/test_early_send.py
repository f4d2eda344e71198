"""Messages the engine thread writes as its pass ends (node/runtime/early_send.py, `Row.to`): the core names where
a hidden decode row's plain activation goes, the engine thread writes it to the peer's data link from its own
thread, and the core routes only what was not written. Links over real loopback sockets, in order with the loop's
own writes; refused where only the loop can write."""

import asyncio
import dataclasses
import socket
import threading

import numpy as np
import pytest

from node.core.actions import Deliver, Send
from node.core.requests import Activation, TokenMessage
from node.core.step_plan import Follow, Row, Sampling, StepOutputs, StepPlan, relayed_pass
from node.grpc.link import packed
from node.grpc.link.client import LinkConnection
from node.grpc.link.server import LinkServer
from node.runtime.early_send import EarlySend
from node.runtime.engine_step import Executed, run_pass
from node.security.keys import ClusterKey, generate_secret
from shards.decoding.grammar import Constraint
from shards.decoding.sampling import SampleResult, SamplerState, SamplingParams
from shards.engines.numpy_engine import NumpyEngine
from shards.formats.config import ModelConfig
from shards.model.shard import Shard
from tests.support.factories import ADDR, CFG, STOP, hidden, logits, spec, tokens
from tests.support.models import FIXTURES
from tests.unit.test_link import BOUND, Node, peer_with_a_link, refused, send_of
from tests.unit.test_step_plan import core, of, sized

MIDDLE = Shard("llama", 2, 4, 6)
SAMPLE = Sampling(SamplingParams(temperature=0), SamplerState.from_seed(1))


def decoding_at_b():
    """A middle node of a three-node ring: the prompt computed and sent on (its spec with it), a decode row taken."""
    b = core("b")
    b.accept_activations([Activation("r1", hidden(4), sized("r1", max_tokens=5))])
    (prompt,) = b.take_batch()
    assert prompt.rows[0].to is None  # a prompt is no decode row
    (send,) = of(Send, b.step_done(prompt, StepOutputs({"r1": hidden(4)})))
    assert send.activations[0].spec is not None  # the first message to c carries the spec
    b.accept_activations([Activation("r1", hidden())], "a")
    (plan,) = b.take_batch()
    return b, plan


# -- the core names the destination and routes only what was not written -----------------------------------------
def test_a_decode_row_is_written_early_only_once_its_spec_went():
    b, plan = decoding_at_b()
    assert (plan.rows[0].to, plan.rows[0].back) == (ADDR["c"], None)
    a = core("a")  # the first node: its token's row, once the prompt's message carried the spec
    a.accept_prompt(spec("r1", max_tokens=5), tokens(1, 2, 3))
    (prompt,) = a.take_batch()
    a.step_done(prompt, StepOutputs({"r1": hidden(3)}))
    a.accept_activations([Activation("r1", tokens(9))], "c")
    ((row,),) = [p.rows for p in a.take_batch()]
    assert row.to == ADDR["b"]


def last_node(entry: str = "a", max_tokens: int = 5, **kw):
    """A ring's last node, its request's prompt sampled, a decode row taken."""
    c = core("c")
    request = dataclasses.replace(spec("r1", max_tokens=max_tokens, entry=entry), prompt_tokens=4, **kw)
    c.accept_activations([Activation("r1", hidden(4), request)])
    (prompt,) = c.take_batch()
    assert prompt.rows[0].to is None
    c.step_done(prompt, StepOutputs({"r1": logits()}, samples={"r1": SampleResult(7)}))
    c.accept_activations([Activation("r1", hidden())], "b")
    (plan,) = c.take_batch()
    return c, plan


def test_a_last_nodes_token_goes_back_early_to_a_first_node_that_is_its_entry_while_it_goes_on():
    c, plan = last_node()
    (row,) = plan.rows
    assert row.to == ADDR["a"] and row.back == Follow(frozenset({STOP}), 4)  # the prompt's token was the first
    assert [r.to for r in last_node(entry="entry")[1].rows] == [None]  # the delivery goes elsewhere: two messages
    grammar = SamplingParams(temperature=0, constraint=Constraint("%llguidance {}\nstart: /[0-9]+/"))
    assert [r.to for r in last_node(sampling=grammar)[1].rows] == [None]
    nxt = relayed_pass(plan, {"r1": hidden()})
    assert nxt.rows[0].back == Follow(frozenset({STOP}), 3)  # one token fewer left, pass by pass
    for _ in range(2):
        nxt = relayed_pass(nxt, {"r1": hidden()})
    assert nxt.rows[0].back.left == 1 and nxt.rows[0].back.ends(8)  # its token is the last: the core sends that


def test_the_core_delivers_and_sends_back_only_what_the_engine_thread_did_not():
    c, plan = last_node()
    actions = c.step_done(plan, StepOutputs({"r1": logits()}, samples={"r1": SampleResult(8)}, sent=frozenset({"r1"})))
    assert of(Send, actions) == [] and of(Deliver, actions) == []
    assert c.requests["r1"].generated == 2 and c.counters["written_rows"] == 1
    c.accept_activations([Activation("r1", hidden())], "b")
    (plan,) = c.take_batch()
    actions = c.step_done(plan, StepOutputs({"r1": logits()}, samples={"r1": SampleResult(9)}))
    assert [d.message.results for d in of(Deliver, actions)] == [(SampleResult(9),)]
    assert [s.activations[0].data.tolist() for s in of(Send, actions)] == [[9]]
    c.accept_activations([Activation("r1", hidden())], "b")
    (plan,) = c.take_batch()  # a token the engine thread sent on that ends the request after all: it ends, finished
    actions = c.step_done(plan, StepOutputs({"r1": logits()}, samples={"r1": SampleResult(9)}, sent=frozenset({"r1"})))
    c.accept_activations([Activation("r1", hidden())], "b")
    (plan,) = c.take_batch()
    actions = c.step_done(plan, StepOutputs({"r1": logits()}, samples={"r1": SampleResult(9)}, sent=frozenset({"r1"})))
    (end,) = of(Deliver, actions)
    assert end.message == TokenMessage("r1", (), True, "length") and "r1" not in c.requests and of(Send, actions) == []


def test_the_core_routes_what_the_engine_thread_did_not_write_and_only_that():
    b, plan = decoding_at_b()
    assert of(Send, b.step_done(plan, StepOutputs({"r1": hidden()}, sent=frozenset({"r1"})))) == []
    assert b.counters["written_rows"] == 1 and b.requests["r1"].positions_in == 5
    b.accept_activations([Activation("r1", hidden())], "a")
    (plan,) = b.take_batch()
    (send,) = of(Send, b.step_done(plan, StepOutputs({"r1": hidden()})))  # not written: routed as before
    assert send.address == ADDR["c"] and send.activations[0].spec is None


def test_a_relayed_pass_keeps_its_rows_destination():
    b, plan = decoding_at_b()
    nxt = relayed_pass(plan, {"r1": hidden()})
    assert nxt.rows[0].to == ADDR["c"]


def test_only_a_hidden_one_position_step_without_proposals_or_start_gets_a_destination():
    for bad in (
        {"data": hidden(2)},
        {"partial": True},
        {"start": 3},
        {"data": tokens(1, 2), "proposals": (2,), "start": 0},
    ):
        with pytest.raises(ValueError, match="written early"):
            Row(**{"request_id": "r", "data": hidden(), "to": "h:1", **bad})
    with pytest.raises(ValueError, match="sent without outputs"):
        StepOutputs({}, sent=frozenset({"r"}))


# -- the engine thread's half: which rows, and what it hands the loop ----------------------------------------------
def pass_of(rows: dict, outputs: dict) -> Executed:
    plan = StepPlan(MIDDLE, None, tuple(Row(rid, hidden(), to=to) for rid, to in rows.items()))
    return Executed(plan, StepOutputs(outputs))


def test_rows_with_a_destination_go_one_message_per_peer_and_the_rest_stay_the_cores():
    calls = []

    def write(address, activations, messages):
        calls.append((address, [a.request_id for a in activations]))
        return lambda: None

    early = EarlySend(CFG, write, 1 << 20)
    done = early(
        pass_of({"r1": "h:1", "r2": "h:2", "r3": "h:1", "r4": None}, {k: hidden() for k in "r1 r2 r3 r4".split()})
    )
    assert calls == [("h:1", ["r1", "r3"]), ("h:2", ["r2"])]
    assert done.outputs.sent == {"r1", "r2", "r3"} and [w.address for w in done.written] == ["h:1", "h:2"]
    assert all(w.at >= done.ended for w in done.written)


def test_a_pass_writes_its_rows_as_it_ends_before_its_records_are_made():
    """`run_pass` with an early writer: the row goes to the transport once the engine computed it, the pass's end is
    taken before the write (the write's time is the hop's, not the pass's), and the records name what was written."""
    engine = NumpyEngine(FIXTURES / "llama", MIDDLE, ModelConfig.from_dir(FIXTURES / "llama"))
    run_pass(engine, StepPlan(MIDDLE, None, (Row("r1", hidden(4), 20),)), None)
    calls = []

    def write(address, activations, messages):
        calls.append((address, [a.request_id for a in activations], activations[0].data.copy()))
        return lambda: None

    plan = StepPlan(MIDDLE, None, (Row("r1", hidden(), 20, to="h:3"),))
    done = run_pass(engine, plan, None, early=EarlySend(CFG, write, 1 << 20))
    ((address, ids, data),) = calls
    assert (address, ids) == ("h:3", ["r1"]) and np.array_equal(data, done.outputs.outputs["r1"])
    assert done.outputs.sent == {"r1"} and [w.address for w in done.written] == ["h:3"]
    assert done.written[0].at >= done.ended >= done.began
    assert run_pass(engine, dataclasses.replace(plan, rows=(Row("r1", hidden(), 20),)), None).written == ()


def test_nothing_is_written_where_an_output_is_malformed_or_the_transport_cannot_write_now():
    calls = []
    early = EarlySend(CFG, lambda address, activations, messages: calls.append(address), 1 << 20)  # (None: can't)
    done = early(pass_of({"r1": "h:1"}, {"r1": hidden()}))
    assert calls == ["h:1"] and done.outputs.sent == frozenset() and done.written == ()
    calls.clear()
    nan = hidden()
    nan[0, 3] = np.nan
    for outputs in ({"r1": hidden(), "r2": nan}, {"r1": hidden(), "r2": np.zeros((1, 3), np.float32)}):
        done = early(pass_of({"r1": "h:1", "r2": "h:1"}, outputs))
        assert calls == [] and done.outputs.sent == frozenset()  # (step_done fails the pass's rows)
    too_small = EarlySend(CFG, lambda address, activations, messages: calls.append(address), 16)
    too_small(pass_of({"r1": "h:1"}, {"r1": hidden()}))
    assert calls == []  # over the message's room: the outbox cuts it


# -- the link's half: written from another thread, in order with the loop's writes --------------------------------
async def link_to(server: LinkServer, context=None) -> LinkConnection:
    return await LinkConnection.open("127.0.0.1", server.port, BOUND, 2.0, context)


def row_message(name: str) -> bytes:
    return packed.pack((Activation(name, np.zeros((1, 8), np.float32)),), ())


KEY = ClusterKey(generate_secret())


async def served(keyed: bool) -> tuple[LinkServer, Node, LinkConnection]:
    """A link server and a link to it: plain, or mutual TLS under a cluster key, whose records the client seals
    itself (node/grpc/link/tls_session.py) under the lock every write holds, so another thread writes there too."""
    server, node = LinkServer("127.0.0.1", 0, BOUND, tls=KEY.tls("srv") if keyed else None), Node()
    await server.start(node)
    return server, node, await link_to(server, KEY.tls("cli").ssl_context(server=False) if keyed else None)


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "keyed"])
def test_a_message_written_from_another_thread_is_answered_on_the_loop_in_order_with_the_loops_own(keyed):
    async def go():
        server, node, link = await served(keyed)
        loop, answers, names = asyncio.get_running_loop(), [], []
        for i in range(30):
            if i % 2:
                waiter = await loop.run_in_executor(None, link.write_now, row_message(f"bad{i}"))
                assert waiter is not None
                answers.append(link.answer(waiter))
            else:
                answers.append(link.post(send_of(f"m{i}")))  # (written now)
            names.append(f"bad{i}" if i % 2 else f"m{i}")
        got = await asyncio.gather(*answers)
        assert [refused(a) for a in got] == [[n] if n.startswith("bad") else [] for n in names]
        assert node.arrived == names and server.counters["link_packed"] == 15
        assert set(node.callers) == {"cli" if keyed else None}  # (under TLS the server names its caller)
        link.close()
        assert link.write_now(row_message("late")) is None  # a closed link writes nothing
        await server.stop()

    asyncio.run(go())


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "keyed"])
def test_what_the_socket_did_not_take_goes_before_the_loops_next_write(keyed):
    """A peer that reads slowly: the socket takes part of a large message written from another thread; the rest
    goes first when the loop writes next, so the peer reads whole messages in order (under TLS the rest of records
    the session counted: never dropped, never sealed again)."""

    async def go():
        server, node, link = await served(keyed)
        link.direct.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        for s in server.connections:
            s.transport.pause_reading()
        big = packed.pack((Activation("big", np.ones((1, 200_000), np.float32)),), ())
        waiter = link.write_now(big)  # (from the loop's thread here: the loop has not written the rest yet)
        assert waiter is not None and link.rest
        assert link.write_now(row_message("other")) is None  # nothing overtakes that rest
        after = link.post(send_of("after"))
        for s in server.connections:
            s.transport.resume_reading()
        await asyncio.gather(link.answer(waiter), after)
        assert node.arrived == ["big", "after"] and not link.rest
        link.close()
        await server.stop()

    asyncio.run(go())


def test_a_link_ended_while_another_thread_writes_fails_its_answer_not_the_thread():
    async def go():
        server, node = LinkServer("127.0.0.1", 0, BOUND), Node()
        await server.start(node)
        link = await link_to(server)
        stop, results = threading.Event(), []

        def writer():
            while not stop.is_set():
                results.append(link.write_now(row_message("r")))

        thread = threading.Thread(target=writer)
        thread.start()
        await asyncio.sleep(0.05)
        link.close()
        await asyncio.sleep(0.01)
        stop.set()
        thread.join(5)
        waiters = [w for w in results if w is not None]
        assert waiters and results[-1] is None  # once closed, nothing more is written
        outcomes = await asyncio.gather(*(link.answer(w) for w in waiters), return_exceptions=True)
        assert all(not isinstance(o, BaseException) or "closed" in str(o) for o in outcomes)
        await server.stop()

    asyncio.run(go())


def test_an_engine_thread_pass_round_trip_through_a_real_transport():
    """EarlySend over GrpcTransport's write_now and a real link: the row is written, the answer awaited on the loop."""

    async def go():
        async with peer_with_a_link() as (transport, address, node, _):
            await transport.health_check(address)
            for _ in range(200):  # the link comes up in the background
                if transport.links.get(address) is not None:
                    break
                await asyncio.sleep(0.01)
            early = EarlySend(CFG, transport.write_now, 1 << 20)
            loop = asyncio.get_running_loop()
            done = await loop.run_in_executor(None, early, pass_of({"bad1": address}, {"bad1": hidden()}))
            (written,) = done.written
            assert [r.request_id for r in await written.answer()] == ["bad1"] and node.arrived == ["bad1"]

    asyncio.run(go())


def test_early_send_refuses_a_roomless_message_bound():
    with pytest.raises(ValueError, match="positive"):
        EarlySend(CFG, lambda *_: None, 0)


def test_a_last_shards_token_goes_back_with_its_delivery_only_while_it_goes_on():
    calls = []

    def write(address, activations, messages):
        calls.append((address, [(a.request_id, a.data.tolist()) for a in activations], messages))
        return lambda: None

    early, last = EarlySend(CFG, write, 1 << 20), Shard("llama", 4, 6, 6)
    back, last_two = Follow(frozenset({STOP}), 3), Follow(frozenset({STOP}), 2)
    rows = tuple(Row(rid, hidden(), sample=SAMPLE, to="h:1", back=back) for rid in ("r1", "r2", "r3"))
    rows += (Row("r4", hidden(), sample=SAMPLE, to="h:1", back=last_two),)
    samples = {"r1": SampleResult(8, -0.5), "r2": SampleResult(STOP), "r3": SampleResult(9), "r4": SampleResult(9)}
    outputs = {"r1": logits(), "r2": logits(), "r3": None, "r4": logits()}  # r3's token the engine picked
    done = early(Executed(StepPlan(last, None, rows), StepOutputs(outputs, samples=samples)))
    assert calls == [
        (
            "h:1",
            [("r1", [8]), ("r3", [9])],
            (TokenMessage("r1", (samples["r1"],)), TokenMessage("r3", (samples["r3"],))),
        )
    ]
    # r2's stop token: the core ends the request and says so; r4's token is among its request's last two, which the
    # core's count of the tokens may be a pass behind on when it planned the row (early_send.STALE_PASSES)
    assert done.outputs.sent == {"r1", "r3"}
    assert done.written[0].messages == calls[0][2]
