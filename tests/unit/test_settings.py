"""What the flags do, read off the settings objects `settings_from_args` builds: nothing is started, bound or loaded
(node/settings.py)."""

import pytest

from node.core.admission import CoreLimits
from node.runtime.settings import NodeSettings
from node.settings import Machine, parse_args, settings_from_args

MACHINE = Machine(hostname="box", available_memory=10 * 2**30, lan_host="192.168.1.7")


def settings(*flags, keyed=False, machine=MACHINE):
    return settings_from_args(parse_args(["--engine", "numpy", *flags]), keyed=keyed, machine=machine)


def test_defaults_describe_a_local_node_on_loopback():
    s = settings()
    assert (s.grpc.host, s.grpc.port, s.grpc.advertise_host) == ("127.0.0.1", 50051, "127.0.0.1")
    assert (s.http.host, s.http.port, s.http.api.api_key) == ("127.0.0.1", 52415, None)
    assert s.node.memory_bytes == 10 * 2**30 and s.node.engine == "numpy" and s.node.pinned is None
    assert s.node.core.kv_budget == int(0.4 * 10 * 2**30)  # 40% of the available memory


def test_the_node_id_is_stable_per_host_and_port_and_random_for_port_0():
    assert settings().node.node_id == settings().node.node_id
    assert settings().node.node_id != settings(machine=Machine("other", 2**30, "10.0.0.1")).node.node_id
    assert settings("--grpc-port", "0").node.node_id != settings("--grpc-port", "0").node.node_id
    assert settings("--node-id", "n7").node.node_id == "n7"


def test_a_cluster_key_opens_grpc_to_the_lan_and_peers_reach_it_at_the_lan_address():
    s = settings(keyed=True)
    assert (s.grpc.host, s.grpc.advertise_host) == ("0.0.0.0", "192.168.1.7")
    assert settings("--host", "10.1.1.1", keyed=True).grpc.advertise_host == "10.1.1.1"
    assert settings("--advertise-host", "node3.lan", keyed=True).grpc.advertise_host == "node3.lan"


def test_the_cores_limits_come_from_the_flags_once():
    s = settings(
        "--kv-memory-gb",
        "2",
        "--request-idle-timeout",
        "9",
        "--step-tokens",
        "64",
        "--max-stall",
        "3",
        "--kv-entry-share",
        "0.25",
    )
    assert s.node.core == CoreLimits(
        kv_budget=2 * 2**30, kv_value_bytes=s.node.core.kv_value_bytes, idle_timeout=9.0, kv_entry_share=0.25
    )
    assert settings().node.core.kv_entry_share == 0.5
    assert (s.node.scheduling.step_tokens, s.node.scheduling.max_stall) == (64, 3.0)
    assert not any(hasattr(s.node, name) for name in ("kv_budget", "max_requests", "request_idle_timeout"))


def test_api_flags():
    s = settings(
        "--api-key",
        "k",
        "--cors-origins",
        " https://a.example, ,https://b.example",
        "--max-body-kb",
        "2",
        "--api-port",
        "0",
        "--http-timeout",
        "4",
    )
    assert (s.http.api.api_key, s.http.api.cors_origins) == ("k", ("https://a.example", "https://b.example"))
    assert (s.http.api.max_body_bytes, s.http.port, s.http.header_timeout) == (2048, 0, 4.0)
    assert settings("--no-api").http is None


def test_shard_flag():
    assert settings("--shard", "2:5").node.pinned == (2, 5)
    for bad in ("5", "a:b", "5:2", "3:3"):
        with pytest.raises(ValueError, match="--shard"):
            settings("--shard", bad)


def test_nonsense_settings_are_refused_with_the_flag_to_fix():
    with pytest.raises(ValueError, match="--request-timeout"):
        settings("--request-timeout", "0")
    with pytest.raises(ValueError, match="--memory-gb"):
        settings("--memory-gb", "0")
    with pytest.raises(ValueError, match="--kv-entry-share"):
        settings("--kv-entry-share", "1.5")
    with pytest.raises(ValueError, match="--sample-batch-max"):
        NodeSettings(node_id="n", memory_bytes=1, sample_batch_max=0)
