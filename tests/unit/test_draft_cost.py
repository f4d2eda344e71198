"""Speculation priced by what a draft row costs where it is verified: an accepted draft saves a step, a proposed
one costs `row_cost` of one (measured at start: node/runtime/calibration.py `draft_row_cost`), so a request's
proposals go on only while the share of them accepted stays above that cost (shards/decoding/speculation.py
DraftLength). Where rows ride free (float weights read once for all rows) nothing changes."""

import asyncio
import dataclasses
import math

import numpy as np
import pytest

from node.core.placement.layer_costs import layer_costs
from node.core.requests import Activation
from node.core.speculation import Speculation, SpeculationLimits
from node.grpc.client import GrpcTransport
from node.runtime import calibration
from node.runtime.calibration import LayerSpeed, draft_row_cost
from node.runtime.node import Node
from node.runtime.settings import NodeSettings, ServedModel
from shards.decoding.speculation import DraftLength
from shards.engines.base import StepInput
from shards.engines.numpy_engine import NumpyEngine
from shards.engines.registry import engine_factory
from shards.formats.config import ModelConfig
from shards.formats.tokenizer import Tokenizer
from shards.model.shard import Shard
from tests.support.factories import tokens
from tests.support.models import FIXTURES
from tests.unit.test_core_speculation import Fixed, first_node, queued, request

LLAMA = FIXTURES / "llama"


def trips(length: DraftLength, accepted_of: list[tuple[int, int]]) -> list[int]:
    """Drive `length` through trips of (at most proposed, accepted); the lengths it asked for, 0 while paused."""
    asked = []
    for most, accepted in accepted_of:
        k = length.next()
        asked.append(k)
        if k:
            length.update(min(k, most), min(accepted, k, most))
    return asked


def test_half_the_drafts_accepted_pause_where_a_row_costs_more_than_half_a_step():
    """Two drafts a trip, one accepted: a step saved for 1.2 steps of rows (a CPU computing a quantized model).
    From a hopeful start (rate 1) the request's rate falls below the cost on its fifth trip."""
    asked = trips(DraftLength(4, row_cost=0.6), [(2, 1)] * 5 + [(1, 0)] * 4)
    assert asked[:5] == [2, 2, 2, 2, 2] and asked[5:] == [0, 0, 0, 0]  # then a pause, as after misses


def test_the_same_acceptance_goes_on_where_rows_ride_free():
    """row_cost 0 (no calibration, or weights read once for every row): today's rule, only failures pause."""
    assert 0 not in trips(DraftLength(4), [(2, 1)] * 12)
    assert 0 not in trips(DraftLength(4, row_cost=0.05), [(2, 1)] * 12)


def test_drafts_that_pay_for_their_rows_keep_growing():
    assert trips(DraftLength(6, row_cost=0.6), [(8, 8)] * 7) == [2, 3, 4, 5, 6, 6, 6]


def test_after_a_pause_a_passage_that_repeats_brings_the_proposals_back():
    length = DraftLength(4, row_cost=0.6, backoff=2)
    trips(length, [(2, 1)] * 5)  # paused for 2
    assert trips(length, [(8, 8)] * 6) == [0, 0, 1, 2, 3, 4]


def test_a_request_starts_where_the_nodes_recent_requests_left_the_rate():
    assert trips(DraftLength(4, row_cost=0.6, rate=0.5, backoff=4), [(8, 8)] * 6) == [0, 0, 0, 0, 1, 2]
    assert trips(DraftLength(4, row_cost=0.6, rate=0.7), [(8, 8)] * 2) == [2, 3]


def test_a_node_whose_requests_paid_too_little_starts_the_next_one_paused():
    """Through the core: the first request proposes while its rate is hopeful, then pauses; the node's rate
    follows its trips, so the next request does not pay those trips again."""
    a = first_node(Fixed())
    a.speculation.priced(0.6)
    a.accept_activations([Activation("r1", tokens(5))])
    proposed = []
    for _ in range(8):
        item = queued(a)
        proposed.append(len(item.proposals))
        accepted = min(1, len(item.proposals))  # the first draft, never the second
        a.accept_activations([Activation("r1", tokens(42), start=item.start + 1 + accepted)])
    assert proposed[:5] == [2, 2, 2, 2, 2] and 0 in proposed[5:]
    assert a.speculation.rate <= 0.6
    a.accept_prompt(dataclasses.replace(request(), request_id="r2"), tokens(1, 2, 3, 4))
    a.queue.queue.clear()
    a.accept_activations([Activation("r2", tokens(5))])
    assert queued(a).proposals == ()


@pytest.mark.parametrize("bad", [-0.1, math.inf, math.nan, "0.5", None])
def test_a_row_cost_that_is_no_finite_share_is_refused(bad):
    with pytest.raises(ValueError, match="row_cost"):
        DraftLength(4, row_cost=bad)
    with pytest.raises(ValueError, match="cost"):
        Speculation(None, SpeculationLimits(), vocab=10).priced(bad)


def test_requests_after_the_price_is_known_are_given_it():
    speculation = Speculation(None, SpeculationLimits(), vocab=10)
    assert speculation.row_cost == 0.0  # free until measured
    speculation.priced(0.55)
    assert speculation.row_cost == 0.55


def test_a_draft_rows_cost_is_measured_on_a_real_engine_and_leaves_nothing_in_its_cache():
    cfg = ModelConfig.from_dir(LLAMA)
    for shard in (Shard("llama", 0, 1, cfg.n_layers), Shard("llama", 1, cfg.n_layers, cfg.n_layers)):  # tokens, hidden
        engine = NumpyEngine(LLAMA, shard, cfg)
        try:
            cost = draft_row_cost(engine, cfg)
            assert cost is not None and 0 <= cost < math.inf
            assert engine.cache_bytes() == 0  # the calibration's requests were released
        finally:
            engine.close()


def calibrated(speed: LayerSpeed) -> list[float]:
    """What a node's calibration (on the llama fixture, the numpy engine, rounds back to back) priced draft rows at."""
    cfg, priced = ModelConfig.from_dir(LLAMA), []

    async def on_a_thread(fn, *args):
        return await asyncio.to_thread(fn, *args)

    asyncio.run(
        calibration.calibrate_node(
            on_a_thread, NumpyEngine, LLAMA, "llama", cfg, layer_costs(cfg), speed, drafts=priced.append
        )
    )
    return priced


def test_the_node_calibration_prices_draft_rows_once(monkeypatch):
    monkeypatch.setattr(calibration, "ROUND_GAP_S", 0.0)
    priced = calibrated(LayerSpeed(layer_costs(ModelConfig.from_dir(LLAMA))))
    assert len(priced) == 1 and 0 <= priced[0] < math.inf


def test_a_node_with_a_fixed_speed_builds_no_engine_at_start_and_prices_its_drafts_on_its_own_once_idle(monkeypatch):
    """--speed fixes what placement balances, not what a draft row costs: that is measured all the same, on the
    engine the node serves with once it holds no request (a slice of its own would be memory the planner never
    counted), and the calibration at start builds nothing."""
    monkeypatch.setattr(calibration, "IDLE_POLL_S", 0.02)
    cfg, priced, built = ModelConfig.from_dir(LLAMA), [], []

    async def on_a_thread(fn, *args):
        return await asyncio.to_thread(fn, *args)

    def factory(*args):
        built.append(args)
        return NumpyEngine(*args)

    speed = LayerSpeed(layer_costs(cfg), fixed=2.5)
    asyncio.run(
        calibration.calibrate_node(
            on_a_thread, factory, LLAMA, "llama", cfg, layer_costs(cfg), speed, drafts=priced.append
        )
    )
    assert built == [] and priced == [] and speed.speed == 2.5

    engine, asked = NumpyEngine(LLAMA, Shard("llama", 0, cfg.n_layers, cfg.n_layers), cfg), []

    def own():  # no shard at first, then one
        asked.append(engine)
        return engine if len(asked) > 1 else None

    async def price() -> None:
        engine.forward([StepInput("busy", tokens=np.array([1, 2]), max_positions=4)])  # a request it serves
        pricing = asyncio.create_task(calibration.price_drafts_on(on_a_thread, own, cfg, priced.append))
        await asyncio.sleep(0.3)
        assert priced == [] and len(asked) > 2  # it waited for a shard, then for the request to end
        engine.release("busy")
        await asyncio.wait_for(pricing, 5)

    try:
        asyncio.run(price())
    finally:
        engine.close()
    assert len(priced) == 1 and 0 <= priced[0] < math.inf and engine.cache_bytes() == 0


def node_with(**settings):
    cfg = ModelConfig.from_dir(LLAMA)
    return Node(
        NodeSettings(node_id="n0", memory_bytes=1 << 30, speed=1.0, **settings),
        ServedModel("llama", LLAMA, cfg, Tokenizer(LLAMA)),
        address="127.0.0.1:1",
        engines=engine_factory("numpy"),
        transport=GrpcTransport(rpc_timeout=5.0),
    )


def test_a_cpu_node_that_proposes_prices_its_draft_rows_once_it_holds_a_shard(monkeypatch):
    monkeypatch.setattr(calibration, "ROUND_GAP_S", 0.0)
    monkeypatch.setattr(calibration, "IDLE_POLL_S", 0.01)

    async def go():
        node = node_with()
        node.start()
        await asyncio.sleep(0.1)
        assert node.core.speculation.row_cost == 0  # (--speed: no engine of its own at start)
        assert not node.counters["startup_done"]  # the pricing is still to come: a benchmark would wait for it
        n = node.config.n_layers
        await node.shards.get(Shard("llama", 0, n, n))
        for _ in range(500):
            if node.counters["startup_done"]:
                break
            await asyncio.sleep(0.01)
        done, cost = node.counters["startup_done"], node.core.speculation.row_cost
        await node.stop()
        return done, cost

    done, cost = asyncio.run(go())
    assert done == 1 and 0 < cost < math.inf  # priced by the time the status says the start-up's work is over


def test_a_node_with_nothing_to_price_ends_its_start_up_work_with_its_calibration():
    async def go():
        node = node_with(speculate="off")
        node.start()
        for _ in range(500):
            if node.counters["startup_done"]:
                break
            await asyncio.sleep(0.01)
        await node.stop()
        return node.counters["startup_done"], node.counters["calibration_done"]

    assert asyncio.run(go()) == (1, 1)  # no shard ever loaded: nothing waits for one


@pytest.mark.parametrize(
    "settings",
    [{"device": "Vulkan0 (llvmpipe)"}, {"speculate": "off"}],
    ids=["a GPU node: its rows ride free", "a node that never proposes"],
)
def test_no_draft_rows_are_timed_where_they_could_not_matter(settings):
    async def go():
        return node_with(**settings)._priced_drafts()

    assert asyncio.run(go()) is None
