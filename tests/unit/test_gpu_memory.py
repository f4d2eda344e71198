"""A GPU node reports its GPU's memory for placement, and its host's beside it: its weights and KV cache live in the
GPU's memory (shards/engines/ggml/on_device.py), so that memory is what caps its share of layers, and the KV budget
is a share of it. A node on the CPU reports the host's, as ever."""

import pytest

from node.core.placement.ring import target_ring
from node.core.topology import Capabilities, NodeInfo
from node.grpc.wire import WireError
from node.grpc.wire_cluster import decode_node_info, encode_node_info
from node.settings import Machine, parse_args, settings_from_args
from node.settings.machine import GpuMemory, gpu_memory
from node.settings.serving import KV_SHARE_OF_MEMORY

GB = 1 << 30
H200 = GpuMemory("CUDA0", "NVIDIA H200", 139 * GB, 140 * GB)
HOST = dict(hostname="box", available_memory=64 * GB, lan_host="192.168.1.7")


def node_settings(machine: Machine, *flags: str):
    return settings_from_args(parse_args(["--engine", "ggml", *flags]), machine=machine).node


def test_a_gpu_node_reports_its_gpus_free_memory_for_its_layers_and_the_hosts_beside_it():
    node = node_settings(Machine(**HOST, gpu=H200))
    assert node.memory_bytes == 139 * GB and node.host_memory_bytes == 64 * GB
    assert node.device == "CUDA0 (NVIDIA H200)"
    assert node.core.kv_budget == int(KV_SHARE_OF_MEMORY * 139 * GB)  # the KV cells are in the GPU's memory too


def test_a_cpu_node_reports_the_hosts_memory_and_no_device():
    node = node_settings(Machine(**HOST))
    assert (node.memory_bytes, node.host_memory_bytes, node.device) == (64 * GB, 64 * GB, "")


def test_memory_gb_still_fixes_what_a_gpu_node_reports():
    assert node_settings(Machine(**HOST, gpu=H200), "--memory-gb", "20").memory_bytes == 20 * GB


def test_the_device_and_host_memory_travel_with_the_capabilities_and_a_hostile_device_name_is_refused():
    info = NodeInfo("a", "127.0.0.1:1000", Capabilities(139 * GB, "ggml", "m", 4, 50.0, "CUDA0 (H200)", 64 * GB))
    caps = decode_node_info(encode_node_info(info)).capabilities
    assert (caps.memory_bytes, caps.device, caps.host_memory_bytes) == (139 * GB, "CUDA0 (H200)", 64 * GB)
    m = encode_node_info(info)
    m.capabilities.device = "x" * 10_000
    with pytest.raises(WireError, match="device"):
        decode_node_info(m)


def test_a_fast_gpu_node_takes_the_layers_its_gpu_memory_holds_and_no_more():
    """Ten times the CPU node's speed would take 27 of 30 layers; its 8 GB of VRAM hold 8 (1 GB each)."""
    gpu = NodeInfo("gpu", "10.0.0.1:1", Capabilities(8 * GB, "ggml", "m", 30, 100.0, "CUDA0", 64 * GB))
    cpu = NodeInfo("cpu", "10.0.0.2:1", Capabilities(64 * GB, "ggml", "m", 30, 10.0))
    ring = {i: s.end_layer - s.start_layer for i, s in target_ring([gpu, cpu], "m", 30, [10**9] * 30, [GB] * 30)}
    assert ring == {"gpu": 8, "cpu": 22}
    by_speed = {i: s.end_layer - s.start_layer for i, s in target_ring([gpu, cpu], "m", 30, [10**9] * 30, None)}
    assert by_speed["gpu"] > 20  # with memory not judged, by speed alone


def test_no_gpu_is_reported_for_another_engine_the_cpu_or_a_machine_without_one():
    assert gpu_memory("numpy", "auto") is None
    assert gpu_memory("ggml", "cpu") is None
    assert gpu_memory("ggml", None) is None


@pytest.mark.parametrize(
    "bad",
    [dict(name="", free=GB, total=GB), dict(name="CUDA0", free=0, total=GB), dict(name="CUDA0", free=2 * GB, total=GB)],
)
def test_a_nonsense_gpu_memory_report_is_refused(bad):
    with pytest.raises(ValueError, match="GPU memory"):
        GpuMemory(description="", **bad)
