"""The node: its part of every request's ring, the pipeline worker, and the entry-side generator.

Token ring: the entry node sends the prompt to the first-shard node; each node runs its layers and forwards the
activations to the next; the last node samples, sends the token to the entry node (for the client) and to the
first node (for the next step). All work that reaches a node is queued, and the worker runs everything queued
together in one forward pass, so concurrent requests batch at every stage of the pipeline.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, defaultdict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from proto import node_service_pb2 as pb
from shards.config import ModelConfig
from shards.engine import Engine, EngineInputError, StepInput
from shards.partition import NodeCapacity, PartitionError, partition
from shards.sampling import SamplerState, SamplingParams
from shards.shard import Shard
from shards.tokenizer import Tokenizer

from . import wire
from .peer import PeerPool
from .plan import PlanError, PlanStep, RequestSpec
from .requests import GenerationError, TokenEvent, RequestState, Tombstones, Work
from .sampling_batcher import BatcherClosed, SampleItem, SamplingBatcher
from .shard_manager import EngineFactory, ShardManager
from .topology import Capabilities, NodeInfo, PeerLink, Topology

log = logging.getLogger(__name__)
LOCAL_WAIT_S = 0.02  # longest the worker holds queued work back for a one-node ring's tokens in flight


@dataclass
class NodeSettings:
    node_id: str
    model_dir: Path
    model_id: str
    address: str  # host:port other nodes use to reach this node's gRPC server
    memory_bytes: int
    engine: str = "numpy"
    pinned: tuple[int, int] | None = None
    max_tensor_bytes: int = 255 * 1024 * 1024
    request_timeout: float = 300.0  # the entry gives up after this long without a token
    max_step_tokens: int = 4096  # rows packed into one forward pass
    max_requests: int = 256  # concurrent requests a node takes part in
    sample_batch_max: int = 8  # sampling batcher: rows per batch ...
    sample_batch_window_ms: float = 5.0  # ... or this long after the batch's first row


class Node:
    def __init__(self, settings: NodeSettings, config: ModelConfig, tokenizer: Tokenizer, factory: EngineFactory,
                 peers: PeerPool):
        self.settings, self.config, self.tokenizer, self.peers = settings, config, tokenizer, peers
        self.id = settings.node_id
        self.shards = ShardManager(settings.model_dir, config, factory)
        self.requests: dict[str, RequestState] = {}
        self.inbox: dict[str, asyncio.Queue[pb.SendResultRequest]] = {}  # requests we are the entry node of
        self.ended = Tombstones()
        self.known_peers: dict[str, NodeInfo] = {}  # filled by discovery
        self.counters: Counter[str] = Counter()
        self.batcher = SamplingBatcher(settings.sample_batch_max, settings.sample_batch_window_ms)
        self.stat_sources: list[Counter[str]] = [self.counters, self.batcher.stats]  # shown in topology status
        self._pending: deque[Work] = deque()
        self._wake = asyncio.Event()
        # Requests of a one-node ring whose next token is being sampled/sent back to us right now: their next
        # step is due within a millisecond or two, so the worker waits for them rather than split the batch.
        self._local_inflight: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._worker: asyncio.Task | None = None

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._worker = asyncio.create_task(self._work_loop(), name="pipeline-worker")

    async def stop(self) -> None:
        tasks = [t for t in [self._worker, *self._tasks] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.batcher.close()
        self.shards.close()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- what this node is ------------------------------------------------------------------------------------
    def info(self) -> NodeInfo:
        s = self.settings
        return NodeInfo(
            node_id=self.id,
            address=s.address,
            capabilities=Capabilities(s.memory_bytes, s.engine, s.model_id, self.config.n_layers),
            pinned=s.pinned,
            loaded=self.shards.loaded,
            active_requests=len(self.requests) + len(self.inbox) + self.shards.active_requests,
            status={k: v for source in self.stat_sources for k, v in source.items()},
        )

    def topology(self) -> Topology:
        peers = tuple(sorted(self.known_peers.values(), key=lambda n: n.node_id))
        return Topology(nodes=(self.info(), *peers), links=tuple(PeerLink(self.id, p.node_id) for p in peers))

    def make_pinned_shard(self) -> Shard:
        start, end = self.settings.pinned
        return Shard(self.settings.model_id, start, end, self.config.n_layers)

    def make_plan(self) -> tuple[PlanStep, ...]:
        """Partition the layers over this node and the peers serving the same model."""
        me = self.info()
        nodes = {me.node_id: me} | {
            n.node_id: n
            for n in self.known_peers.values()
            if (n.capabilities.model_id, n.capabilities.n_layers) == (self.settings.model_id, self.config.n_layers)
        }
        caps = [NodeCapacity(n.node_id, n.capabilities.memory_bytes, n.pinned) for n in nodes.values()]
        try:
            ring = partition(caps, self.settings.model_id, self.config.n_layers)
        except PartitionError as e:
            raise PlanError(str(e)) from None
        return tuple(PlanStep(node_id, nodes[node_id].address, shard) for node_id, shard in ring)

    # -- entry side -------------------------------------------------------------------------------------------
    async def generate(self, prompt: list[int], sampling: SamplingParams, max_tokens: int) -> AsyncIterator[TokenEvent]:
        """Run one request through the ring, yielding tokens as the last node samples them.

        Whatever way this ends (finished, failed, or the consumer went away), every node of the plan is told to
        free the request's state.
        """
        spec = RequestSpec(
            request_id=uuid.uuid4().hex,
            plan=self.make_plan(),
            sampling=sampling,
            max_tokens=max_tokens,
            stop_token_ids=self.tokenizer.eos_token_ids,
            entry_node_id=self.id,
            entry_address=self.settings.address,
        )
        rid = spec.request_id
        inbox = self.inbox[rid] = asyncio.Queue()
        reason = "cancelled"
        self.counters["requests"] += 1
        try:
            request = pb.SendPromptRequest(spec=wire.encode_spec(spec), tokens=wire.encode_tensor(np.asarray(prompt, np.int64)))
            try:
                await self.peers.get(spec.first.address).send_prompt(request)
            except grpc.aio.AioRpcError as e:
                raise GenerationError(f"first node {spec.first.node_id} at {spec.first.address}: {e.details()}") from None
            while True:
                try:
                    msg = await asyncio.wait_for(inbox.get(), self.settings.request_timeout)
                except asyncio.TimeoutError:
                    raise GenerationError(f"no token within {self.settings.request_timeout:g}s") from None
                if msg.finish_reason == "error":
                    raise GenerationError(msg.error or "request failed")
                results = tuple(wire.decode_result(t) for t in msg.tokens)
                yield TokenEvent(results, msg.finished, msg.finish_reason or None)
                if msg.finished:
                    reason = "finished"
                    return
        except GenerationError:
            reason = "failed"
            self.counters["requests_failed"] += 1
            raise
        finally:
            self.inbox.pop(rid, None)
            self._spawn(self._end_everywhere(spec, reason))

    async def _end_everywhere(self, spec: RequestSpec, reason: str) -> None:
        async def end(step: PlanStep) -> None:
            try:
                await self.peers.get(step.address).end_request(spec.request_id, reason)
            except grpc.aio.AioRpcError as e:
                log.warning("EndRequest %s to %s failed: %s", spec.request_id, step.node_id, e.code())

        await asyncio.gather(*(end(step) for step in spec.plan))

    # -- RPC handlers -----------------------------------------------------------------------------------------
    def accept_prompt(self, spec: RequestSpec, tokens: np.ndarray) -> None:
        if spec.first.node_id != self.id:
            raise PlanError(f"prompt sent to {self.id}, but the plan's first node is {spec.first.node_id}")
        if tokens.dtype != np.int64 or tokens.ndim != 1 or len(tokens) == 0:
            raise PlanError("prompt tokens must be a non-empty int64 vector")
        if spec.request_id in self.requests or spec.request_id in self.ended:
            raise PlanError(f"request {spec.request_id} already exists")
        self._admit(spec)
        self._enqueue(Work(spec.request_id, tokens))

    def accept_tensors(self, entries: list[tuple[str, np.ndarray, RequestSpec | None]]) -> list[tuple[str, str]]:
        """Queue each entry; returns (request_id, reason) for the ones refused."""
        rejected = []
        for rid, data, spec in entries:
            if rid in self.ended:
                continue  # the request is over; a late activation is simply dropped
            try:
                req = self.requests.get(rid)
                if req is None:
                    if spec is None:
                        raise PlanError(f"unknown request {rid} (this node has no state for it)")
                    req = self._admit(spec)
                first = req.index == 0
                if first and (data.dtype != np.int64 or data.shape != (1,)):
                    raise PlanError("the first node expects the next token as int64 [1]")
                if not first and (data.dtype != np.float32 or data.ndim != 2):
                    raise PlanError("expected float32 hidden states [T, hidden]")
                self._enqueue(Work(rid, data))
            except PlanError as e:
                rejected.append((rid, str(e)))
        return rejected

    def accept_result(self, msg: pb.SendResultRequest) -> None:
        inbox = self.inbox.get(msg.request_id)
        if inbox is not None:
            inbox.put_nowait(msg)

    def end_request(self, request_id: str, reason: str) -> None:
        self.ended.add(request_id)
        self._local_inflight.discard(request_id)
        if self.requests.pop(request_id, None) is not None:
            self.counters[f"ended_{reason or 'unknown'}"] += 1
        self.shards.release(request_id)

    def _admit(self, spec: RequestSpec) -> RequestState:
        index = spec.step_of(self.id)
        shard = spec.plan[index].shard
        if (shard.model_id, shard.n_layers) != (self.settings.model_id, self.config.n_layers):
            raise PlanError(f"plan asks for {shard}, this node serves {self.settings.model_id} "
                            f"with {self.config.n_layers} layers")
        if len(self.requests) >= self.settings.max_requests:
            raise PlanError(f"node {self.id} is at its limit of {self.settings.max_requests} requests")
        req = RequestState(spec, index)
        if shard.is_last:
            req.sampler = SamplerState.from_seed(spec.sampling.seed)
        self.requests[spec.request_id] = req
        return req

    def _enqueue(self, work: Work) -> None:
        self._pending.append(work)
        self._local_inflight.discard(work.request_id)
        self._wake.set()

    # -- the pipeline worker ----------------------------------------------------------------------------------
    async def _work_loop(self) -> None:
        while True:
            if not self._pending or self._local_inflight:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), LOCAL_WAIT_S if self._pending else None)
                    continue
                except asyncio.TimeoutError:
                    self._local_inflight.clear()  # a straggler: stop waiting for it
            batch = self._take_batch()
            if batch:
                try:
                    await self._step(batch)
                except Exception as e:  # a bug: fail this batch's requests, keep serving the others
                    log.exception("pipeline step failed")
                    for w in batch:
                        self._fail(w.request_id, f"node {self.id}: internal error: {e}")

    def _take_batch(self) -> list[Work]:
        batch, ids, rows, later = [], set(), 0, []
        while self._pending:
            w = self._pending.popleft()
            if w.request_id not in self.requests:
                continue  # ended while queued
            if w.request_id in ids or (batch and rows + len(w.data) > self.settings.max_step_tokens):
                later.append(w)
                break
            batch.append(w)
            ids.add(w.request_id)
            rows += len(w.data)
        self._pending.extendleft(reversed(later))
        return batch

    async def _step(self, batch: list[Work]) -> None:
        groups: dict = defaultdict(list)
        for w in batch:
            req = self.requests.get(w.request_id)
            if req is None:
                continue
            groups[req.spec.plan[req.index].shard].append(w)
        for shard, works in groups.items():
            try:
                engine = await self.shards.get(shard)
            except Exception as e:
                for w in works:
                    self._fail(w.request_id, f"node {self.id} cannot load {shard}: {e}")
                continue
            await self._run(engine, works)

    async def _run(self, engine: Engine, works: list[Work]) -> None:
        inputs = []
        for w in works:
            if w.request_id not in self.requests:
                continue  # ended while its shard was loading
            item = StepInput(w.request_id, tokens=w.data) if engine.shard.is_first else StepInput(w.request_id, hidden=w.data)
            try:
                engine.validate([item])
                inputs.append(item)
            except EngineInputError as e:
                self._fail(w.request_id, f"node {self.id}: {e}")
        if not inputs:
            return
        started = time.perf_counter()
        try:
            outputs = await self.shards.run(engine.forward, inputs)
        except Exception as e:
            log.exception("forward failed")
            for i in inputs:
                self._fail(i.request_id, f"node {self.id}: forward failed: {e}")
            return
        for i in inputs:
            if i.request_id not in self.requests:
                # Ended during the forward pass, maybe before this engine existed to queue a release: free the
                # cache the pass just created.
                self.shards.release(i.request_id)
        self.counters["steps"] += 1
        self.counters["step_rows"] += len(inputs)
        self.counters["step_ms_total"] += int((time.perf_counter() - started) * 1000)
        if engine.shard.is_last:
            self._sample(engine, inputs, outputs)
        else:
            self._dispatch_hidden(inputs, outputs)

    def _sample(self, engine: Engine, inputs: list[StepInput], logits: list[np.ndarray]) -> None:
        """Hand each request's logits row to the sampling batcher; tokens are dispatched as they resolve."""
        futures = {}
        for item, rows in zip(inputs, logits):
            req = self.requests.get(item.request_id)
            if req is None:
                continue
            sample = SampleItem(item.request_id, rows[-1], req.spec.sampling, req.sampler, engine, self.settings.model_id)
            try:
                futures[item.request_id] = self.batcher.submit(sample)
            except (ValueError, BatcherClosed) as e:
                self._fail(item.request_id, f"node {self.id}: cannot sample: {e}")
        if not self._pending:
            self.batcher.flush()  # no more forward passes queued here: nothing else can join this batch
        self._local_inflight.update(r for r in futures if len(self.requests[r].spec.plan) == 1)
        self._spawn(self._dispatch_tokens(futures))

    def _dispatch_hidden(self, inputs: list[StepInput], outputs: list[np.ndarray]) -> None:
        by_address: dict[str, list[pb.TensorEntry]] = defaultdict(list)
        for item, out in zip(inputs, outputs):
            req = self.requests.get(item.request_id)
            if req is None:
                continue  # ended during the forward pass
            by_address[req.spec.plan[req.index + 1].address].append(self._entry(req, out))
        for address, entries in by_address.items():
            self._spawn(self._send_tensors(address, entries))

    async def _dispatch_tokens(self, futures: dict[str, asyncio.Future]) -> None:
        results = await asyncio.gather(*futures.values(), return_exceptions=True)
        to_first: dict[str, list[pb.TensorEntry]] = defaultdict(list)
        for rid, result in zip(futures, results):
            req = self.requests.get(rid)
            if req is None:
                continue
            if isinstance(result, BaseException):
                self._fail(rid, f"node {self.id}: sampling failed: {type(result).__name__}: {result}")
                continue
            req.generated += 1
            spec = req.spec
            reason = "stop" if result.token in spec.stop_token_ids else "length" if req.generated >= spec.max_tokens else None
            msg = pb.SendResultRequest(request_id=spec.request_id, tokens=[wire.encode_result(result)],
                                       finished=reason is not None, finish_reason=reason or "")
            self._spawn(self._send_result(spec.entry_address, msg))
            if reason is None:
                to_first[spec.first.address].append(self._entry(req, np.array([result.token], dtype=np.int64)))
            else:
                self.end_request(spec.request_id, "finished")
        for address, entries in to_first.items():
            self._spawn(self._send_tensors(address, entries))

    def _entry(self, req: RequestState, data: np.ndarray) -> pb.TensorEntry:
        entry = pb.TensorEntry(request_id=req.spec.request_id, tensor=wire.encode_tensor(data))
        if not req.spec_sent and req.index + 1 < len(req.spec.plan):
            entry.spec.CopyFrom(wire.encode_spec(req.spec))
            req.spec_sent = True
        return entry

    async def _send_tensors(self, address: str, entries: list[pb.TensorEntry]) -> None:
        try:
            response = await self.peers.get(address).send_tensor(pb.SendTensorRequest(entries=entries))
        except grpc.aio.AioRpcError as e:
            for entry in entries:
                self._fail(entry.request_id, f"node {self.id}: sending to {address} failed: {e.code().name} {e.details()}")
            return
        for rejected in response.rejected:
            self._fail(rejected.request_id, f"node at {address} refused: {rejected.reason}")

    async def _send_result(self, address: str, msg: pb.SendResultRequest) -> None:
        try:
            await self.peers.get(address).send_result(msg)
        except grpc.aio.AioRpcError as e:
            log.warning("result for %s to entry %s failed: %s", msg.request_id, address, e.code())
            self.end_request(msg.request_id, "failed")

    def _fail(self, request_id: str, message: str) -> None:
        """Drop our state for a failed request and tell its entry node why."""
        req = self.requests.get(request_id)
        self.end_request(request_id, "failed")
        if req is None:
            return
        log.warning("request %s failed: %s", request_id, message)
        msg = pb.SendResultRequest(request_id=request_id, finished=True, finish_reason="error", error=message)
        self._spawn(self._send_result(req.spec.entry_address, msg))

