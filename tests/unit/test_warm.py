"""Warming (node/runtime/pipeline.py `_warm`, node/grpc/link/server.py `warm`): a ring's node that waited for its
input runs, after the pass that input fed, what taking its next input takes, while the ring leaves it idle, so that
the code and data are in its core's cache when that input comes. A warmer changes nothing: one that fails is
logged and the others run, and the ring's tokens are a one-node run's.

Driven on a live two-node ring in process (numpy engines on the llama fixture, each pass paced as a real model's so
each node waits for the other, gRPC between them); the link's own warming is in test_link.py, the core's question in
test_relay_row.py.
"""

import asyncio
import logging
import time

from discovery.static import StaticDiscovery
from node.runtime.membership import Membership
from node.runtime.pipeline import WARM_WAIT_S
from shards.decoding.sampling import SamplingParams
from shards.engines.registry import engine_factory
from tests.unit.test_token_hold import serving

PASS_S = 0.005  # each pass's pace: the other node's wait for its input, well over WARM_WAIT_S


def test_a_ring_node_that_waits_for_its_input_warms_after_each_pass_it_fed_and_a_failing_warmer_changes_nothing(
    caplog,
):
    assert PASS_S > 2 * WARM_WAIT_S
    numpy = engine_factory("numpy")

    def paced(path, shard, cfg):
        engine = numpy(path, shard, cfg)
        forward = engine.forward

        def slow(*args, **kw):
            time.sleep(PASS_S)
            return forward(*args, **kw)

        engine.forward = slow
        return engine

    def broken():
        raise RuntimeError("a warmer's bug")

    async def run(entry) -> list[int]:
        got = []
        async for message in entry.generate([1, 2, 3, 4], SamplingParams(temperature=0), 12):
            got += [r.token for r in message.results]
        return got

    async def go():
        n0, s0 = await serving("n0", (0, 3), paced)
        n1, s1 = await serving("n1", (3, 6), paced)
        warmed: dict[str, list[int]] = {"n0": [], "n1": []}  # the node's relayed rows so far, at each warming
        waiting: list[bool] = []  # whether its engine thread waited for its input then
        for node in (n0, n1):
            node.warm_with(broken)
            node.warm_with(lambda node=node: warmed[node.id].append(node.core.counters["relayed_rows"]))
            node.warm_with(lambda node=node: waiting.append(node.pipeline.following.relay.waiting))
        for a, b in ((n0, n1), (n1, n0)):
            await Membership(a.id, a.address, a.transport, [StaticDiscovery([b.address])], a.update_peers).refresh()
        alone, sa = await serving("alone", (0, 6), paced)
        try:
            ring, reference = await run(n0), await run(alone)
            relayed = {node.id: node.core.counters["relayed_rows"] for node in (n0, n1)}
        finally:
            for node, server in ((n0, s0), (n1, s1), (alone, sa)):
                await server.stop(0)
                await node.stop()
                await node.transport.close()
        return ring, reference, warmed, relayed, waiting

    with caplog.at_level(logging.ERROR, logger="node.runtime.pipeline"):
        ring, reference, warmed, relayed, waiting = asyncio.run(go())
    assert ring == reference
    for node_id, counts in warmed.items():
        # after relayed passes only, once each: every decode pass after the first few was relayed
        assert 0 < len(counts) <= relayed[node_id] and counts == sorted(set(counts)), (node_id, counts, relayed)
        assert len(counts) >= 8, (node_id, counts)
    assert all(waiting) and len(waiting) == sum(map(len, warmed.values()))  # only while the next input was due
    failures = [r for r in caplog.records if "warming the next input's taking failed" in r.getMessage()]
    assert len(failures) == sum(map(len, warmed.values()))  # the broken warmer ran as often, and only logged
