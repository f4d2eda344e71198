"""A node's gRPC surface, in process: hostile or stray input is refused cleanly, big tensors pass the 4 MiB cap."""

import asyncio
import threading

import grpc
import numpy as np
import pytest

from node.core.plan import PlanStep, RequestSpec
from node.grpc import wire, wire_cluster
from node.grpc.client import DEFAULT_MAX_MESSAGE_BYTES, GrpcTransport, channel_options
from node.grpc.generated import node_service_pb2 as pb
from node.grpc.generated import node_service_pb2_grpc as pb_grpc
from node.grpc.server import GrpcServer
from node.runtime import node as node_module
from node.runtime.node import Node
from node.runtime.settings import NodeSettings, ServedModel
from node.runtime.shard_manager import ShardManager
from shards.decoding.grammar import Constraint, grammar_tokenizer, json_schema_grammar
from shards.decoding.sampling import SamplingParams
from shards.engines.numpy_engine import NumpyEngine
from shards.engines.registry import engine_factory
from shards.formats.config import ModelConfig
from shards.formats.tokenizer import Tokenizer
from shards.model.shard import Shard
from tests.conftest import FIXTURES

MODEL = FIXTURES / "llama"


def run(coro):
    return asyncio.run(coro)


class RawClient:
    """Sends protobuf messages as they are, hostile ones included (the transport would refuse to build them)."""

    def __init__(self, address):
        self.channel = grpc.aio.insecure_channel(address, options=channel_options(DEFAULT_MAX_MESSAGE_BYTES))
        self.stub = pb_grpc.NodeServiceStub(self.channel)

    async def send_prompt(self, request):
        return await self.stub.SendPrompt(request, timeout=10)

    async def send(self, request):
        """One message on a data-path stream of its own (as a peer's first message), and its answer."""
        call = self.stub.SendStream(timeout=10)
        try:
            await call.write(request)
            return await call.read()
        finally:
            call.cancel()

    async def end_request(self, request_id, reason, **branch):
        request = pb.EndRequestRequest(request_id=request_id, reason=reason, **branch)
        return await self.stub.EndRequest(request, timeout=10)

    async def health_check(self):
        return await self.stub.HealthCheck(pb.HealthCheckRequest(), timeout=10)

    async def close(self):
        await self.channel.close()


async def serving(pinned=None, node_id="n0", rpc_timeout=10.0):
    cfg = ModelConfig.from_dir(MODEL)
    server = GrpcServer("127.0.0.1", 0, DEFAULT_MAX_MESSAGE_BYTES)
    # a fixed speed: no calibration passes on the engine thread while a test measures or steps the node
    settings = NodeSettings(node_id=node_id, memory_bytes=1 << 30, pinned=pinned, max_tensor_bytes=8 << 20, speed=1.0)
    node = Node(
        settings,
        ServedModel("llama", MODEL, cfg, Tokenizer(MODEL)),
        address=f"127.0.0.1:{server.port}",
        engines=engine_factory("numpy"),
        transport=GrpcTransport(rpc_timeout=rpc_timeout),
    )
    node.start()
    await server.start(node)
    return node, server, RawClient(node.address)


async def shutdown(node, server, client):
    await client.close()
    await server.stop(0)
    await node.stop()
    await node.transport.close()


def spec_for(node, plan_nodes=(("n0", 0, 3), ("other", 3, 6)), rid="r1", prompt_tokens=0):
    plan = tuple(
        PlanStep(n, node.address if n == node.id else "127.0.0.1:9", Shard("llama", a, b, 6)) for n, a, b in plan_nodes
    )
    # the other nodes of the plan are members as far as this node knows (as membership would have found them)
    node.update_peers({}, alive={n: "127.0.0.1:9" for n, _, _ in plan_nodes if n != node.id})
    return RequestSpec(
        rid, plan, SamplingParams(temperature=0), 4, frozenset({509}), "n0", node.address, prompt_tokens=prompt_tokens
    )


def test_health_check_describes_the_node():
    async def go():
        node, server, client = await serving(pinned=(0, 3))
        try:
            info = wire_cluster.decode_node_info((await client.health_check()).node)
            assert (info.node_id, info.address, info.pinned, info.capabilities.n_layers) == (
                "n0",
                node.address,
                (0, 3),
                6,
            )
        finally:
            await shutdown(node, server, client)

    run(go())


@pytest.mark.parametrize(
    "tensor",
    [
        pb.Tensor(data=b"\0" * 12, shape=[4], dtype="float64"),
        pb.Tensor(data=b"\0" * 12, shape=[4], dtype="float32"),  # 4 floats need 16 bytes
        pb.Tensor(data=b"", shape=[-1], dtype="float32"),
        pb.Tensor(data=b"\0" * 8, shape=[1], dtype="pickle"),
    ],
)
def test_malformed_tensors_are_invalid_argument(tensor):
    async def go():
        node, server, client = await serving()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.send(pb.SendRequest(entries=[pb.TensorEntry(request_id="x", tensor=tensor)]))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # and the node still works
            assert (await client.health_check()).ok
        finally:
            await shutdown(node, server, client)

    run(go())


def test_tensor_over_the_size_cap_is_refused():
    async def go():
        node, server, client = await serving()
        try:
            big = np.zeros(((9 << 20) // 4 // 64, 64), dtype=np.float32)  # 9 MiB > the node's 8 MiB cap
            entry = pb.TensorEntry(request_id="x", tensor=wire.encode_tensor(big))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.send(pb.SendRequest(entries=[entry]))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await shutdown(node, server, client)

    run(go())


def test_messages_larger_than_grpcs_default_4mib_get_through():
    async def go():
        node, server, client = await serving()
        try:
            # 5 MiB of activations in one message: whole prompts (as much as the context takes) of 84 requests
            hidden = np.zeros((252, 64), dtype=np.float32)
            entries = [
                pb.TensorEntry(
                    request_id=f"r{i}",
                    tensor=wire.encode_tensor(hidden),
                    spec=wire.encode_spec(
                        spec_for(node, (("a", 0, 3), ("n0", 3, 6)), rid=f"r{i}", prompt_tokens=len(hidden))
                    ),
                )
                for i in range(84)
            ]
            response = await client.send(pb.SendRequest(entries=entries))
            assert pb.SendRequest(entries=entries).ByteSize() > 5 << 20 and list(response.rejected) == []
        finally:
            await shutdown(node, server, client)

    run(go())


def test_stray_activations_for_unknown_requests_are_rejected_per_entry():
    async def go():
        node, server, client = await serving()
        try:
            entry = pb.TensorEntry(request_id="nobody", tensor=wire.encode_tensor(np.zeros((1, 64), np.float32)))
            response = await client.send(pb.SendRequest(entries=[entry]))
            assert [(r.request_id, "unknown request" in r.failure.detail) for r in response.rejected] == [
                ("nobody", True)
            ]
            assert node.info().active_requests == 0
        finally:
            await shutdown(node, server, client)

    run(go())


def test_prompt_sent_to_the_wrong_node_is_invalid_argument():
    async def go():
        node, server, client = await serving()
        try:
            spec = spec_for(node, (("other", 0, 3), ("n0", 3, 6)))
            req = pb.SendPromptRequest(spec=wire.encode_spec(spec), tokens=wire.encode_tensor(np.array([1, 2])))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.send_prompt(req)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "first node is other" in e.value.details()
        finally:
            await shutdown(node, server, client)

    run(go())


@pytest.mark.parametrize(
    "branch,why",
    [
        ({"branch_of": "r0"}, "go together"),
        ({"branch_at": 16}, "go together"),
        ({"branch_of": "r 0", "branch_at": 16}, "must be a request id"),
        ({"branch_of": "r" * 200, "branch_at": 16}, "must be a request id"),
    ],
)
def test_an_end_with_a_malformed_branch_is_refused_as_invalid(branch, why):
    async def go():
        node, server, client = await serving()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.end_request("r1", "finished", **branch)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details()
        finally:
            await shutdown(node, server, client)

    run(go())


def test_end_request_frees_state_and_late_activations_are_dropped():
    async def go():
        node, server, client = await serving()
        try:
            spec = spec_for(node, (("a", 0, 3), ("n0", 3, 6)))
            await client.send(
                pb.SendRequest(
                    entries=[
                        pb.TensorEntry(
                            request_id="r1",
                            tensor=wire.encode_tensor(np.zeros((1, 64), np.float32)),
                            spec=wire.encode_spec(spec),
                        )
                    ]
                )
            )
            await client.end_request("r1", "cancelled")
            await node.shards.run(lambda: None)  # wait for queued releases on the engine thread
            assert node.info().active_requests == 0
            late = await client.send(
                pb.SendRequest(
                    entries=[
                        pb.TensorEntry(
                            request_id="r1",
                            tensor=wire.encode_tensor(np.zeros((1, 64), np.float32)),
                            spec=wire.encode_spec(spec),
                        )
                    ]
                )
            )
            assert list(late.rejected) == [] and node.info().active_requests == 0
        finally:
            await shutdown(node, server, client)

    run(go())


def test_concurrent_loads_of_one_shard_happen_once():
    loads = []

    def factory(model_dir, shard, config):
        loads.append(shard)
        return NumpyEngine(model_dir, shard, config)

    async def go():
        manager = ShardManager(MODEL, ModelConfig.from_dir(MODEL), factory)
        shard = Shard("llama", 0, 3, 6)
        engines = await asyncio.gather(*(manager.get(shard) for _ in range(5)))
        assert len({id(e) for e in engines}) == 1 and loads == [shard]
        await manager.get(Shard("llama", 3, 6, 6))  # reassignment: the idle old shard is unloaded
        assert manager.loaded == (Shard("llama", 3, 6, 6),)
        manager.close()

    run(go())


def test_a_pinned_shard_past_the_models_layers_is_refused_before_anything_starts():
    settings = NodeSettings(node_id="n0", memory_bytes=1 << 30, pinned=(3, 9))
    with pytest.raises(ValueError, match=r"--shard 3:9: the model has 6 layers; need END <= 6"):
        Node(
            settings,
            ServedModel("llama", MODEL, ModelConfig.from_dir(MODEL), Tokenizer(MODEL)),
            address="127.0.0.1:1",
            engines=engine_factory("numpy"),
            transport=GrpcTransport(),
        )


def test_a_node_builds_the_grammar_view_only_beside_a_pass_that_samples_a_constrained_row(monkeypatch):
    """llguidance's view of the vocabulary (19 MB for a 32k vocabulary; every node built it at start) is built on
    the grammar thread when a pass about to run samples a constrained row, once, beside that pass: a node serving
    free requests never holds it, and a constrained request's sampling waits at most for what is left of it."""
    built = []

    def view(tokenizer):
        built.append(threading.current_thread().name)
        return grammar_tokenizer(tokenizer)

    monkeypatch.setattr(node_module, "grammar_tokenizer", view)

    async def go():
        node, server, client = await serving()
        try:
            free = [m async for m in node.generate([5, 6, 7], SamplingParams(temperature=0), 3)]
            assert free[-1].finished and built == []
            digits = Constraint(json_schema_grammar({"type": "integer"}))
            params = SamplingParams(temperature=0, constraint=digits)
            for _ in range(2):
                out = [m async for m in node.generate([5, 6, 7], params, 3)]
                assert out[-1].finished and not out[-1].error
            assert built and built[0].startswith("grammar")
        finally:
            await shutdown(node, server, client)

    run(go())
