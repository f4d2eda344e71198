"""A pass's messages written at once (node/runtime/pipeline.py `_post`, `Transport.post`): where the transport can
write without waiting (a data link up), the pass's messages for a peer leave in the callback that brings the pass
back, one message per peer; their answer is what the outbox's call would have been, refusals and failures included:
a request whose message is refused or lost fails, never vanishes. Where the transport can't, the outbox sends them.

A real node (numpy engine, the llama fixture) in process, its peer a transport whose answers the test chooses.
"""

import asyncio

import numpy as np

from node.core.failures import Failure, FailureKind
from node.core.plan import PlanStep, RequestSpec
from node.core.requests import Refusal
from node.grpc.client import DEFAULT_MAX_MESSAGE_BYTES
from node.runtime.node import Node
from node.runtime.settings import NodeSettings, ServedModel
from node.runtime.transport import TransportError
from shards.decoding.sampling import SamplingParams
from shards.engines.registry import engine_factory
from shards.formats.config import ModelConfig
from shards.formats.tokenizer import Tokenizer
from shards.model.shard import Shard
from tests.conftest import FIXTURES

MODEL = FIXTURES / "llama"
PEER = "127.0.0.1:9"


class Peer:
    """The transport to one peer, which answers every message with `answer` (a list of refusals, or an exception to
    raise); `link`: whether it can write at once."""

    max_message_bytes = DEFAULT_MAX_MESSAGE_BYTES

    def __init__(self, answer, link: bool = True):
        self.answer, self.link = answer, link
        self.posted: list[tuple] = []
        self.sent: list[tuple] = []

    def post(self, address, activations, messages, *, on_write=None):
        if not self.link:
            return None
        self.posted.append((address, activations, messages))
        if on_write is not None:
            on_write()
        return self._answered()

    async def send(self, address, activations, messages, *, on_write=None):
        self.sent.append((address, activations, messages))
        return await self._answered()

    async def _answered(self):
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    async def end_request(self, *args, **kw):
        pass

    async def forget(self, address):
        pass

    async def close(self):
        pass


async def prompted(peer: Peer) -> Node:
    """A node that is the first of a two-node plan, its prompt taken: its pass's hidden rows go to PEER."""
    cfg = ModelConfig.from_dir(MODEL)
    settings = NodeSettings(node_id="n0", memory_bytes=1 << 30, max_tensor_bytes=8 << 20, speed=1.0)
    node = Node(
        settings,
        ServedModel("llama", MODEL, cfg, Tokenizer(MODEL)),
        address="127.0.0.1:1",
        engines=engine_factory("numpy"),
        transport=peer,
    )
    node.start()
    plan = (PlanStep("n0", node.address, Shard("llama", 0, 3, 6)), PlanStep("p", PEER, Shard("llama", 3, 6, 6)))
    node.update_peers({}, alive={"p": PEER})
    spec = RequestSpec("r1", plan, SamplingParams(temperature=0), 4, frozenset({509}), "n0", node.address)
    node.accept_prompt(spec, np.array([5, 6, 7], np.int64))
    for _ in range(500):
        if peer.posted or peer.sent:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the answer's handling
    return node


def test_a_pass_whose_peer_has_a_link_up_writes_its_message_at_once_in_one_call():
    async def go():
        peer = Peer([])
        node = await prompted(peer)
        try:
            ((address, activations, messages),) = peer.posted
            assert address == PEER and [a.request_id for a in activations] == ["r1"] and messages == ()
            assert activations[0].spec is not None and activations[0].data.shape == (3, 64)
            assert peer.sent == [] and "r1" in node.core.requests  # taken: it waits for its next token
            assert not node.pipeline.sending  # the answer came: nothing owed
        finally:
            await node.stop()

    asyncio.run(go())


def test_a_message_written_at_once_and_refused_fails_its_request_as_the_outboxs_would():
    async def go():
        peer = Peer([Refusal("r1", Failure(FailureKind.REFUSED, "no room for it", "p"))])
        node = await prompted(peer)
        try:
            assert peer.posted and "r1" not in node.core.requests
            failure = node.core.ended.failure("r1")
            assert failure.kind is FailureKind.REFUSED and "no room for it" in str(failure)
        finally:
            await node.stop()

    asyncio.run(go())


def test_a_message_written_at_once_whose_link_breaks_fails_its_request_as_lost():
    async def go():
        peer = Peer(TransportError(Failure(FailureKind.LOST, "the peer closed the link", PEER)))
        node = await prompted(peer)
        try:
            failure = node.core.ended.failure("r1")
            assert peer.posted and failure.kind is FailureKind.LOST and "the peer closed the link" in str(failure)
            assert not node.pipeline.sending
        finally:
            await node.stop()

    asyncio.run(go())


def test_without_a_link_up_the_outbox_sends_the_message():
    async def go():
        peer = Peer([], link=False)
        node = await prompted(peer)
        try:
            ((address, activations, _),) = peer.sent
            assert peer.posted == [] and address == PEER and activations[0].request_id == "r1"
        finally:
            await node.stop()

    asyncio.run(go())
