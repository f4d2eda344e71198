"""A head stored wider than the layers costs more per parameter (node/core/placement/layer_costs.py `head_weight`):
where decode reads every weight once a token, a Q8_0 head beside Q4_1 layers (SmolLM2's file) takes 1.7x the time a
parameter that the layers take, and the last stage must hold fewer layers for the ring to be balanced. Where its
kernels bound it instead, the nodes' own measure says what it costs (node/runtime/calibration.py `measure_head`),
and a ring goes by that."""

import asyncio
import math

import pytest

from node.core.placement.layer_costs import (
    engine_head_weight,
    head_params,
    head_weight,
    layer_costs,
    ring_head_weight,
)
from node.core.placement.partition import NodeCapacity, partition
from node.core.topology import Capabilities, NodeInfo
from node.grpc.wire import WireError
from node.grpc.wire_cluster import decode_node_info, encode_node_info
from node.runtime.calibration import LayerSpeed, calibrate_node, head_slice, head_weight_of
from shards.engines.numpy_engine import NumpyEngine
from shards.formats.config import ModelConfig
from shards.formats.loader import load_config
from shards.formats.packaged import DEFAULT_MODEL, resolve_model
from shards.model.shard import Shard
from tests.support.models import FIXTURES

GB = 1 << 30


def test_a_q8_0_head_beside_q4_1_layers_weighs_1_7_layer_parameters_and_uniform_files_1():
    path, _ = resolve_model(DEFAULT_MODEL)
    assert head_weight(path, load_config(path)) == 27 / 16  # Q8_0's 34 bytes a block of 32 over Q4_1's 20, to 1/16
    assert head_weight(FIXTURES / "gguf" / "llama31.gguf", load_config(FIXTURES / "gguf" / "llama31.gguf")) == 1.0
    assert head_weight(FIXTURES / "llama", load_config(FIXTURES / "llama")) == 1.0  # a checkpoint: computed alike


def test_the_weight_counts_the_head_only():
    cfg = load_config(resolve_model(DEFAULT_MODEL)[0])
    plain, weighted = layer_costs(cfg), layer_costs(cfg, 27 / 16)
    assert plain[:-1] == weighted[:-1]
    assert (
        weighted[-1] - plain[-1] == round(cfg.vocab_size * cfg.hidden_size * 27 / 16) - cfg.vocab_size * cfg.hidden_size
    )
    with pytest.raises(ValueError, match="head weight"):
        layer_costs(cfg, 0)


def test_the_last_node_of_a_ring_with_a_wide_head_holds_fewer_layers():
    """SmolLM2's Q4_1 file on a fast host and a host at half a core (the placement benchmark's 14.1 and 8.0
    Gparam/s): counting the head by parameters put 24 layers on the fast host, by bytes 28, the best static split
    measured (112.7 tok/s at 8 streams against 95.2 for 24)."""
    cfg = load_config(resolve_model(DEFAULT_MODEL)[0])
    nodes = [NodeCapacity("host0", 10 * GB, speed=14.1), NodeCapacity("host1", 10 * GB, speed=8.0)]

    def first_stage(costs):
        return {i: s.end_layer - s.start_layer for i, s in partition(nodes, "m", cfg.n_layers, costs, None)}["host0"]

    assert first_stage(layer_costs(cfg)) == 24
    assert first_stage(layer_costs(cfg, 27 / 16)) == 28


def test_only_an_engine_keeping_the_files_types_weighs_the_head():
    path, _ = resolve_model(DEFAULT_MODEL)
    assert engine_head_weight(path, "ggml", None) == 27 / 16
    assert engine_head_weight(path, "ggml", "none") == 27 / 16  # --quantize none: the file's types, as without it
    assert engine_head_weight(path, "ggml", "f16") == 1.0  # the packaged default: every matrix requantized to F16
    assert engine_head_weight(path, "numpy", None) == 1.0  # dequantized to float32 alike
    assert engine_head_weight(None, "ggml", None) == 1.0  # still fetching: no file to read


def test_the_measured_weight_is_the_heads_time_over_its_parameters_at_the_layers_rate():
    cfg = load_config(resolve_model(DEFAULT_MODEL)[0])
    mid, last = Shard("m", 14, 16, 30), head_slice("m", 30)
    assert (last.start_layer, last.end_layer) == (28, 30)
    per_param = 1e-3 / (2 * layer_costs(cfg)[14])  # 1 ms for the two middle layers
    head = head_params(cfg) * per_param
    assert head_weight_of(cfg, mid, 1e-3, last, 1e-3 + 1.1 * head) == 18 / 16  # 1.1, to 1/16
    assert head_weight_of(cfg, mid, 1e-3, last, 1e-3 + 1.7 * head) == 27 / 16  # what the file's bytes say
    assert head_weight_of(cfg, mid, 1e-3, last, 0.9e-3) == 1 / 16  # noise: never zero or below
    assert head_slice("m", 2) is None  # the calibration slice is the whole model: nothing to tell the head from


def test_a_ring_weighs_the_head_by_the_median_its_nodes_measured_else_by_the_file():
    assert ring_head_weight([0.0, 1.0, 1.125, 2.0, 2.5], 27 / 16) == 1.125  # the lower of the middle two
    assert ring_head_weight([0.0, 1.125, 0.0], 27 / 16) == 1.125  # 0: not measured
    assert ring_head_weight([0.0, 0.0], 27 / 16) == 27 / 16


def test_two_equal_nodes_that_measured_a_cheaper_head_give_the_last_more_layers():
    """SmolLM2's Q4_1 file on two equal one-core nodes of this Intel Xeon: counted by bytes, the head put 22 layers on
    the first (131-135 tok/s at 8 streams); the nodes measured 0.75 and 0.8125 (Q8_0's dot product costs less per
    byte than Q4_1's), which puts 18 there (148-151 tok/s; 0:17 measured 148-152, 0:19 143-144)."""
    cfg = load_config(resolve_model(DEFAULT_MODEL)[0])
    nodes = [NodeCapacity("a", 10 * GB, speed=10.0), NodeCapacity("b", 10 * GB, speed=10.0)]

    def first_stage(weight):
        return partition(nodes, "m", cfg.n_layers, layer_costs(cfg, weight), None)[0][1].end_layer

    assert first_stage(27 / 16) == 22
    assert first_stage(ring_head_weight([0.75, 0.8125], 27 / 16)) == 18


def test_the_measured_head_weight_travels_with_the_capabilities_and_a_hostile_one_is_refused():
    m = encode_node_info(NodeInfo("a", "127.0.0.1:1000", Capabilities(GB, "ggml", "m", 30, 1.0)))
    m.capabilities.head_weight = 1.125
    assert decode_node_info(m).capabilities.head_weight == 1.125
    for bad in (-1.0, math.nan, math.inf, 1e9):
        m.capabilities.head_weight = bad
        with pytest.raises(WireError, match="head weight"):
            decode_node_info(m)


def test_a_node_whose_head_differs_times_it_with_the_last_layers_on_its_engine_thread():
    """Calibration with `head` (the engine keeps the head in another type than the layers): a second engine on the
    last layers with the head, timed step for step with the middle slice's, then freed at once."""
    cfg = ModelConfig.from_dir(FIXTURES / "llama")
    speed = LayerSpeed(layer_costs(cfg))
    made = []

    def factory(*args):
        made.append(NumpyEngine(*args))
        return made[-1]

    async def on_a_thread(fn, *args):
        return await asyncio.to_thread(fn, *args)

    asyncio.run(
        calibrate_node(on_a_thread, factory, FIXTURES / "llama", "llama", cfg, layer_costs(cfg), speed, head=True)
    )
    assert speed.speed > 0 and speed.head_weight > 0
    assert [e.shard.end_layer == cfg.n_layers for e in made] == [False, True]  # the middle slice, then the last
    assert speed.costs == layer_costs(cfg, speed.head_weight)  # a last shard's live passes go by it
