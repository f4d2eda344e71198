"""A node: owns its parts and their lifetimes, and is what the gRPC server and the HTTP API talk to.

The parts, each with one job:
- `NodeCore` (node/core/node_core.py): every decision about the requests this node takes part in, pure;
- `Pipeline` (pipeline.py): runs the forward passes the core schedules and carries out its actions;
- `PeerView` (peers.py): what the node knows of the other members;
- `Entry` (entry.py): the requests this node is the entry of (plan, prompt, tokens back, replays);
- `ShardManager` and `SamplingBatcher`: the engines and their one thread, and batched sampling.

Other layers use the small surface below: what peers send (`accept_*`, `end_request`, `peer_leaving`), what the
API asks (`generate`, `topology`, `make_plan`, `status`, ...), and start/stop/drain; never the parts themselves.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping

import numpy as np

from node.core.node_core import NodeCore
from node.core.placement.layer_costs import layer_costs, ring_head_weight
from node.core.plan import PlanStep, RequestSpec
from node.core.prefix_cache import PrefixIndex
from node.core.requests import Activation, Refusal, TokenMessage
from node.core.speculation import Speculation
from node.core.topology import Availability, Capabilities, NodeInfo, PeerLink, Topology
from node.runtime.calibration import LayerSpeed, calibrate_node, cpu_share, price_drafts_on
from node.runtime.entry import Entry
from node.runtime.keep_awake import KeepAwake
from node.runtime.loop_monitor import LoopMonitor
from node.runtime.metrics import NodeMetrics, NodeStatus
from node.runtime.peers import PeerView
from node.runtime.pipeline import Pipeline
from node.runtime.planning import LayerFootprints, make_plan
from node.runtime.proposers import proposer_for
from node.runtime.sampling_batcher import SamplingBatcher
from node.runtime.settings import NodeSettings, ServedModel
from node.runtime.shard_manager import EngineCalls, EngineFactory, RetainedStatus, ShardManager
from node.runtime.transport import Loopback, Transport
from shards.decoding.grammar import grammar_tokenizer
from shards.decoding.sampling import SamplingParams
from shards.formats.config import ModelConfig
from shards.formats.tokenizer import Tokenizer
from shards.model.shard import Shard

PREFIX_INDEX_POSITIONS = 1 << 16  # token positions of finished requests the entry remembers for prefix reuse


class Node:
    def __init__(
        self,
        settings: NodeSettings,
        model: ServedModel,
        *,
        address: str,
        engines: EngineFactory,
        transport: Transport,
        availability: Callable[[], Availability] = Availability,
        stat_sources: Iterable[Mapping[str, int]] = (),
        link_port: int = 0,
    ):
        """`address`: host:port other nodes reach this node's gRPC server at (known once the server is bound);
        `link_port`: its data link's port on that host (node/grpc/link/; 0: none);
        `availability`: the layers this node can serve now (all, unless it fetches its weights from a peer:
        node/fetch/follow.py); `stat_sources`: more counters for the node's status (discovery, fetching)."""
        if settings.pinned is not None and settings.pinned[1] > model.config.n_layers:
            raise ValueError(
                f"--shard {settings.pinned[0]}:{settings.pinned[1]}: the model has "
                f"{model.config.n_layers} layers; need END <= {model.config.n_layers}"
            )
        self.settings, self.model, self.address, self.availability = settings, model, address, availability
        self.link_port, self.id = link_port, settings.node_id
        self._footprints = LayerFootprints(model.path, model.config, settings.core.kv_value_bytes, availability)
        self.view = PeerView(self.id, address)
        self.core = NodeCore(
            self.id,
            model.model_id,
            model.config,
            settings.core,
            settings.scheduling,
            members=self.view.known,
            serves=lambda shard: availability().can_serve(shard),
            speculation=Speculation(
                proposer_for(settings, model),
                settings.speculation,
                vocab=model.config.vocab_size,
                deferred=settings.speculate == "draft",  # a draft model computes: off the event loop
            ),
        )
        self.shards = ShardManager(model.path, model.config, engines)
        self._engines = engines
        # what placement balances: sustained, so under a CPU quota a pass's time counts at the node's share of it
        file_costs = layer_costs(model.config, settings.head_weight)
        self._costs = {settings.head_weight: file_costs}  # by head weight
        self.speed = LayerSpeed(file_costs, settings.speed, cpu_share())
        self.batcher = SamplingBatcher(
            settings.sample_batch_max,
            settings.sample_batch_window_ms,
            executor=EngineCalls(self.shards),
            grammar=lambda: grammar_tokenizer(model.tokenizer),
        )
        self.transport = Loopback(self, transport)
        self.metrics = NodeMetrics(
            status=self.status, kv_cache_bytes=self.shards.cache_bytes, name_of=self.view.name_of
        )
        self.pipeline = Pipeline(
            self.core,
            self.shards,
            self.batcher,
            self.transport,
            model_id=model.model_id,
            metrics=self.metrics,
            spawn=self._spawn,
            local=self.transport,
            speed=self.speed,
        )
        self.counters: Counter[str] = Counter()  # the entry's
        self.entry = Entry(
            self.id,
            address,
            self.transport,
            plan=self.make_plan,
            stop_token_ids=model.tokenizer.eos_token_ids,
            request_timeout=settings.request_timeout,
            max_replays=settings.max_replays,
            queue_timeout=settings.queue_timeout,
            counters=self.counters,
            spawn=self._spawn,
            vocab_size=model.config.vocab_size,
            prefixes=None if settings.prefix_cache == "off" else PrefixIndex(PREFIX_INDEX_POSITIONS),
            per_key=settings.prefix_cache == "per-key",
            hold=self.pipeline.hold,
        )
        self._stat_sources = [
            self.counters,
            self.view.counters,
            self.pipeline.counters,
            self.core.counters,
            self.batcher.stats,
            self.metrics.status,
            RetainedStatus(self.shards),
            *stat_sources,
        ]
        self._tasks: set[asyncio.Task] = set()
        self.keep_awake = KeepAwake(settings.keep_awake) if settings.keep_awake else None
        self._first_speed = asyncio.Event()  # set at the calibration's first round, or when there will be none

    # -- what the API and the tools read ----------------------------------------------------------------------
    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def tokenizer(self) -> Tokenizer:
        return self.model.tokenizer

    @property
    def model_id(self) -> str:
        return self.model.model_id

    @property
    def max_tensor_bytes(self) -> int:
        return self.settings.max_tensor_bytes

    @property
    def draining(self) -> bool:
        return self.core.draining

    def peers(self) -> tuple[NodeInfo, ...]:
        """The live peers new plans may use."""
        return self.view.peers()

    def info(self) -> NodeInfo:
        s = self.settings
        return NodeInfo(
            node_id=self.id,
            address=self.address,
            capabilities=Capabilities(
                s.memory_bytes,
                s.engine,
                self.model_id,
                self.config.n_layers,
                self.speed.speed,
                device=s.device,
                host_memory_bytes=s.host_memory_bytes,
                head_weight=self.speed.head_weight,
            ),
            pinned=s.pinned,
            loaded=self.shards.loaded,
            active_requests=self._active_requests(),
            status={k: v for source in self._stat_sources for k, v in source.items()},
            draining=self.draining,
            availability=self.availability(),
            link_port=self.link_port,
        )

    def status(self) -> NodeStatus:
        return status_of(self)

    def _active_requests(self) -> int:
        return self.core.active + self.entry.active + self.shards.active_requests

    def topology(self) -> Topology:
        peers = self.view.peers()
        return Topology(nodes=(self.info(), *peers), links=tuple(PeerLink(self.id, p.node_id) for p in peers))

    def ring_members(self) -> list[NodeInfo]:
        """This node (unless it drains) and the peers serving the same model: who a ring may hold."""
        me = [] if self.draining else [self.info()]
        return [*me, *self.view.serving(self.model_id, self.config.n_layers)]

    @property
    def layer_costs(self) -> tuple[int, ...]:
        """Each layer's compute (parameters a token goes through), which placement balances against speeds."""
        return self.costs_for(self.ring_members())

    def costs_for(self, members: list[NodeInfo]) -> tuple[int, ...]:
        """`layer_costs` with the head weighed as `members` measured it (the file's ratio until one has)."""
        weight = ring_head_weight((m.capabilities.head_weight for m in members), self.settings.head_weight)
        if weight not in self._costs:
            self._costs[weight] = layer_costs(self.config, weight)
        return self._costs[weight]

    @property
    def layer_footprints(self) -> tuple[int, ...] | None:
        """Each layer's bytes with its KV cache, once this node holds the files (node/runtime/planning.py)."""
        return self._footprints()

    def make_plan(self, excluded: Collection[str] = ()) -> tuple[PlanStep, ...]:
        """A plan over this node and the peers serving the same model, less `excluded` nodes (and this node while
        it drains), and nodes for layers they don't hold yet (node/runtime/planning.py)."""
        members = self.ring_members()
        return make_plan(
            members,
            excluded,
            self.model_id,
            n_layers=self.config.n_layers,
            costs=self.costs_for(members),
            footprints=self.layer_footprints,
        )

    def generate(self, prompt: list[int], sampling: SamplingParams, max_tokens: int) -> AsyncIterator[TokenMessage]:
        """Run one request, with this node as its entry (node/runtime/entry.py)."""
        return self.entry.generate(prompt, sampling, max_tokens)

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._spawn(self.pipeline.work())
        self._spawn(self._expire_loop())
        if self.keep_awake is not None:
            self._spawn(self.keep_awake.run(lambda: self._active_requests() > 0))
        self._spawn(LoopMonitor(self.metrics.loop_lag.observe).run())
        self._spawn(self._calibrate())

    async def _calibrate(self) -> None:
        m, drafts = self.model, self._priced_drafts()
        await calibrate_node(
            self.shards.run,
            self._engines,
            m.path,
            m.model_id,
            m.config,
            self.speed.costs,
            self.speed,
            lambda: self.availability().complete,
            self._first_speed,
            head=self.settings.head_weight != 1.0,  # the engine keeps the head in a wider (or narrower) type
            drafts=drafts,
        )
        self.counters["calibration_done"] = 1  # (status: the start-up rounds' engine is gone; live passes go on)
        if self.speed.fixed is not None and drafts is not None:  # (under --speed, calibrate_node priced nothing)
            await price_drafts_on(
                self.shards.run, lambda: next(iter(self.shards.engines.values()), None), m.config, drafts
            )
        self.counters["startup_done"] = 1  # (status: no start-up passes left; benchmarks wait for it before timing)

    def _priced_drafts(self) -> Callable[[float], None] | None:
        """Draft rows are priced on a CPU node that proposes: a GPU's ride free (its weights read once for all
        rows), and timing four rows there would compile (lavapipe: for seconds) pipelines only calibration uses."""
        speculation = self.core.speculation
        return speculation.priced if speculation.proposer is not None and not self.settings.device else None

    async def first_speed(self, timeout: float) -> None:
        """Wait (up to `timeout` s) for the calibration's first round, which a node holding the whole model runs
        before it joins its peers: the first plan counting it has its speed, and no shard loads beside the round."""
        try:
            await asyncio.wait_for(self._first_speed.wait(), timeout)
        except TimeoutError:
            logging.getLogger(__name__).warning("no speed measured in %gs: joining unmeasured", timeout)

    async def load_pinned(self) -> None:
        """A pinned node knows its shard: load it now rather than at the first request (when it holds it)."""
        if self.settings.pinned is not None:
            shard = Shard(self.model_id, *self.settings.pinned, self.config.n_layers)
            if self.availability().can_serve(shard):
                await self.shards.get(shard)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.settings.core.idle_timeout / 4))
            self.pipeline.do(self.core.expire())

    async def stop(self) -> None:
        self.pipeline.interrupt()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.batcher.close()
        self.shards.close()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def start_draining(self) -> None:
        """Shutting down: take no new request; the ones in flight run to their end (or are replayed elsewhere by
        their entry nodes once this node is gone)."""
        self.core.draining = True

    async def drained(self) -> None:
        """Returns once this node holds no request any more, as entry or as a member of a plan, and has sent what
        it owes its peers (a request's last token leaves after the request has ended here)."""
        while self.core.active or self.entry.active or self.pipeline.sending:
            await asyncio.sleep(0.05)

    # -- what membership and peers tell us (the transport's server side calls these) --------------------------
    def update_peers(self, peers: dict[str, NodeInfo], alive: dict[str, str]) -> None:
        """Membership's latest view (node/runtime/peers.py). Requests we are the entry of lose the nodes that did
        not answer; connections to peers gone for good are closed."""
        for address in self.view.update(peers, alive):
            self._spawn(self.transport.forget(address))
        self.entry.nodes_alive(self.view.known().keys())

    def peer_leaving(self, node_id: str, caller: str | None = None) -> None:
        self.view.leaving(node_id, caller)

    # `caller`: the member calling, authenticated by mutual TLS (None without a cluster key, or when it is us).
    def accept_prompt(self, spec: RequestSpec, tokens: np.ndarray, caller: str | None = None) -> None:
        self.core.accept_prompt(spec, tokens, caller)
        self.pipeline.wake()

    def accept_activations(
        self,
        activations: list[Activation],
        caller: str | None = None,
        *,
        local: bool = False,
        received: float | None = None,
    ) -> list[Refusal]:
        """`local`: this node's own (a one-node ring's next token), not a hop from a peer; `received`: when the
        service had the message (perf_counter), for the hop's counters."""
        if not local:
            return self.pipeline.offer(activations, caller, received)
        rejected = self.core.accept_activations(activations, caller)
        self.pipeline.wake()
        return rejected

    def relay_row(self, request_id: str, data: np.ndarray, caller: str | None, received: float) -> bool:
        """A decode row's input from a peer taken the short way, or False (then `accept_activations`)."""
        return self.pipeline.relay_row(request_id, data, caller, received)

    def would_relay(self, request_id: str, data: np.ndarray, caller: str | None) -> bool:
        return self.core.would_relay(request_id, data, caller)

    def warm_with(self, warm: Callable[[], None]) -> None:
        self.pipeline.warmers.append(warm)

    def accept_tokens(self, message: TokenMessage, caller: str | None = None) -> None:
        self.entry.accept_tokens(message, caller)

    def end_request(
        self, request_id: str, reason: str, caller: str | None = None, branch: tuple[str, int] | None = None
    ) -> None:
        self.pipeline.do(self.core.end_request(request_id, reason, caller, branch))


def status_of(node: Node) -> NodeStatus:
    """What /metrics and the status page show of a node: its parts' counters, gathered."""
    return NodeStatus(
        active_requests=node._active_requests(),
        peers=len(node.view.peers()),
        peers_joined=node.view.counters["peers_joined"],
        peers_left=node.view.counters["peers_left"],
        kv_cache_bytes=node.shards.cache_bytes(),
        weights_bytes=node.shards.weights_bytes(),
        ended={k.removeprefix("ended_"): v for k, v in node.core.counters.items() if k.startswith("ended_")},
        sampling=Counter(node.batcher.stats),
        speculation={k: v for k, v in node.core.counters.items() if k.startswith(("spec_", "tokens_per_trip_"))},
        prefix={
            **{k: v for k, v in node.counters.items() if k.startswith("prefix_")},
            "prefix_gone": node.core.counters["prefix_gone"],
            "prefix_evictions": node.shards.retained_evictions(),
            "retained_bytes": node.shards.retained_bytes(),
            "retained_branches": node.shards.retained_branches(),
        },
    )
