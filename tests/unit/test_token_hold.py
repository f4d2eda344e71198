"""The entry's tokens wait for a decode pass due or running on its node (node/runtime/token_hold.py): a token that
came with the next pass's input reaches its client once that pass ended, in the order tokens and failures came; a
prompt chunk holds nothing, and a worker with no pass to run lets everything through.

The first half drives the hold and the entry with plain values; the last test runs a live two-node ring in process
(numpy engines on the llama fixture, gRPC between them) and reads the entry's passes against its client's tokens.
"""

import asyncio
import time

import numpy as np
import pytest

from discovery.static import StaticDiscovery
from node.core.failures import Failed
from node.core.step_plan import Row, StepPlan
from node.grpc.client import DEFAULT_MAX_MESSAGE_BYTES, GrpcTransport
from node.grpc.server import GrpcServer
from node.runtime.membership import Membership
from node.runtime.node import Node
from node.runtime.settings import NodeSettings, ServedModel
from node.runtime.token_hold import TokenHold, is_decode
from shards.decoding.sampling import SampleResult, SamplingParams
from shards.engines.registry import engine_factory
from shards.formats.config import ModelConfig
from shards.formats.tokenizer import Tokenizer
from shards.model.shard import Shard
from tests.conftest import FIXTURES
from tests.unit.test_entry_results import Ring, entry_for, started, tokens

MODEL = FIXTURES / "llama"
FIRST = Shard("llama", 0, 3, 6)


def plan(*lengths: int) -> StepPlan:
    return StepPlan(FIRST, None, tuple(Row(f"r{i}", np.ones(n, np.int64)) for i, n in enumerate(lengths)))


def test_a_token_goes_to_its_client_at_once_while_no_decode_pass_is_due():
    hold, got = TokenHold(), []
    hold.put(lambda: got.append("t0"))
    assert got == ["t0"] and not hold.closed


def test_tokens_that_came_with_a_decode_pass_wait_for_its_end_and_keep_their_order():
    hold, got = TokenHold(), []
    hold.arrived()  # the message carried the next pass's input, then its token
    hold.put(lambda: got.append("t0"))
    hold.started(plan(1, 1))
    hold.put(lambda: got.append("t1"))  # more arrive while the pass runs
    assert got == []
    hold.ended()
    hold.put(lambda: got.append("t2"))  # after the pass, before its sends left: behind the others
    assert got == []
    hold.release()
    assert got == ["t0", "t1", "t2"] and not hold.closed
    hold.put(lambda: got.append("t3"))
    assert got[-1] == "t3"


def test_a_prompt_chunk_holds_nothing_and_lets_through_what_waited():
    hold, got = TokenHold(), []
    hold.arrived()
    hold.put(lambda: got.append("t0"))
    assert not is_decode(plan(1, 7)) and is_decode(plan(1, 1, 1))
    hold.started(plan(1, 7))  # a chunk takes seconds: the streams beside it would stutter
    assert got == ["t0"]
    hold.arrived()  # a decode input queued behind the chunk does not hold either while the chunk runs
    hold.put(lambda: got.append("t1"))
    assert got == ["t0", "t1"]


def test_a_worker_with_no_pass_to_run_lets_everything_through():
    """Activations that arrived and were dropped (their request ended meanwhile) make no pass: the worker going idle
    hands on what waited for one, and nothing holds after."""
    hold, got = TokenHold(), []
    hold.arrived()
    hold.put(lambda: got.append("t0"))
    hold.idle()
    hold.put(lambda: got.append("t1"))
    assert got == ["t0", "t1"] and not hold.closed


def test_a_failure_reaches_the_entry_behind_the_tokens_held_before_it():
    """The entry's inbox gets what the plan sent in the order it came: a node found dead after its last token was
    held does not overtake that token (the replay would start a token short)."""

    async def go():
        ring = Ring()
        entry = entry_for(ring)
        entry.hold = hold = TokenHold()
        stream, first, rid = await started(entry, ring)
        hold.arrived()
        entry.accept_tokens(tokens(rid, 7), caller="c")
        entry.nodes_alive({"a", "c"})  # membership gave up on b meanwhile
        inbox = entry.attempts[rid].inbox
        assert inbox.empty()
        hold.idle()
        assert (await first).results == (SampleResult(7),)
        with pytest.raises(Failed, match="stopped answering"):
            await anext(stream)

    asyncio.run(go())


async def serving(node_id: str, pinned: tuple[int, int], engines) -> tuple[Node, GrpcServer]:
    server = GrpcServer("127.0.0.1", 0, DEFAULT_MAX_MESSAGE_BYTES)
    node = Node(
        NodeSettings(node_id=node_id, memory_bytes=1 << 30, pinned=pinned, speed=1.0),  # no calibration passes
        ServedModel("llama", MODEL, ModelConfig.from_dir(MODEL), Tokenizer(MODEL)),
        address=f"127.0.0.1:{server.port}",
        engines=engines,
        transport=GrpcTransport(rpc_timeout=5.0),
    )
    node.start()
    await server.start(node)
    return node, server


def test_on_a_live_ring_the_entry_hands_each_token_on_after_the_pass_it_feeds_ended():
    """n0 (layers 0-3, the entry) and n1 (3-6, which samples): each token comes to n0 with the next pass's input.
    The client gets token k only once n0's pass on token k has ended, and the tokens are a one-node run's."""
    passes: list[tuple[tuple[int, ...], float]] = []  # n0's decode passes: (inputs, ended)
    numpy = engine_factory("numpy")

    def recording(path, shard, cfg):
        engine = numpy(path, shard, cfg)
        forward = engine.forward

        def timed(items, **kw):
            out = forward(items, **kw)
            if shard.is_first and all(i.length == 1 for i in items):
                passes.append((tuple(int(i.tokens[0]) for i in items), time.perf_counter()))
            return out

        engine.forward = timed
        return engine

    async def run(nodes: list[Node]) -> list[tuple[int, float]]:
        got = []
        async for message in nodes[0].generate([1, 2, 3, 4], SamplingParams(temperature=0), 10):
            got += [(r.token, time.perf_counter()) for r in message.results]
        return got

    async def go():
        n0, s0 = await serving("n0", (0, 3), recording)
        n1, s1 = await serving("n1", (3, 6), numpy)
        for a, b in ((n0, n1), (n1, n0)):
            await Membership(a.id, a.address, a.transport, [StaticDiscovery([b.address])], a.update_peers).refresh()
        alone, sa = await serving("alone", (0, 6), numpy)
        try:
            ring, reference = await run([n0, n1]), await run([alone])
        finally:
            for node, server in ((n0, s0), (n1, s1), (alone, sa)):
                await server.stop(0)
                await node.stop()
                await node.transport.close()
        assert [t for t, _ in ring] == [t for t, _ in reference]
        assert len(passes) == len(ring) - 1  # every token but the last fed a pass on n0
        for (token, handed), (inputs, ended) in zip(ring, passes):
            assert inputs == (token,) and handed > ended, "a token reached the client before the pass it feeds ended"

    asyncio.run(go())
