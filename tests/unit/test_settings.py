"""What the flags do, read off the settings objects `settings_from_args` builds: nothing is started, bound or loaded
(node/settings.py)."""

import inspect
from pathlib import Path

import pytest

from discovery.manual import ManualDiscovery
from discovery.static import StaticDiscovery
from discovery.udp import UdpDiscovery
from node import cli
from node.core.admission import CoreLimits
from node.fetch.startup import FetchSettings, weight_source
from node.runtime.settings import NodeSettings
from node.settings import EngineSettings, Machine, parse_args, parser, settings_from_args
from tests.unit.test_import_cycles import ROOT, all_imports

MACHINE = Machine(hostname="box", available_memory=10 * 2**30, lan_host="192.168.1.7")
KEYED = Machine(hostname="box", available_memory=10 * 2**30, lan_host="192.168.1.7", key_in_env=True)


def settings(*flags, keyed=False, machine=MACHINE):
    return settings_from_args(parse_args(["--engine", "numpy", *flags]), machine=KEYED if keyed else machine)


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
    s = settings(keyed=True)  # the key in $EXO_NODE_CLUSTER_KEY
    assert (s.grpc.host, s.grpc.advertise_host) == ("0.0.0.0", "192.168.1.7")
    assert settings("--cluster-key-file", "/etc/exo/k").grpc.host == "0.0.0.0"  # or in the flag's file
    assert settings("--cluster-key-file", "/etc/exo/k").security.cluster_key_file == Path("/etc/exo/k")
    assert not settings().security.keyed
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


def test_help_shows_the_flags_in_groups_and_every_flag_is_in_one():
    groups = {g.title: [a.option_strings[0] for a in g._group_actions] for g in parser()._action_groups}
    for title in ("model", "engine", "fetching", "node and gRPC", "discovery", "security", "HTTP API"):
        assert groups[title], title
    assert {"--discovery-port", "--wait-for-peers", "--peers"} <= set(groups["discovery"])
    assert groups["security"] == ["--cluster-key-file"] and "--max-upload-mbps" in groups["fetching"]
    assert groups["options"] == ["-h"]  # argparse's own --help; every flag of ours sits in a group


def test_discovery_flags_become_one_checked_discovery_setting(tmp_path):
    d = settings().discovery
    assert (d.method, d.peers, d.port, d.interval, d.timeout, d.interfaces) == ("udp", (), 5678, 1.0, 5.0, None)
    d = settings(
        "--peers",
        "a:1, b:2,",
        "--discovery-interfaces",
        "eth0, wlan0",
        "--wait-for-peers",
        "2",
        "--discovery-port",
        "9",
    ).discovery
    assert (d.peers, d.interfaces, d.wait_for_peers, d.port) == (("a:1", "b:2"), ("eth0", "wlan0"), 2, 9)
    peers = tmp_path / "peers.json"
    peers.write_text('{"peers": [{"id": "b", "address": "10.0.0.2", "port": 50051}]}')
    d = settings("--discovery", "manual", "--discovery-config", str(peers), "--peers", "c:3").discovery
    found = d.discoveries(lambda: None, None)
    assert [type(x) for x in found] == [StaticDiscovery, ManualDiscovery] and found[0].candidates() == ["c:3"]
    assert [type(x) for x in settings("--discovery", "none").discovery.discoveries(lambda: None, None)] == [
        StaticDiscovery
    ]
    udp = settings("--discovery-interfaces", "eth1").discovery.discoveries(lambda: None, b"k" * 32)[1]
    assert isinstance(udp, UdpDiscovery) and udp.allowed == ["eth1"] and udp.auth is not None


@pytest.mark.parametrize(
    "flags,fix",
    [
        (("--discovery", "manual"), "--discovery-config"),
        (("--peers", "a:1,nonsense"), "HOST:PORT"),
        (("--discovery-interval", "5"), "--discovery-timeout"),
        (("--discovery-port", "70000"), "--discovery-port"),
        (("--wait-for-peers", "-1"), "--wait-for-peers"),
        (("--max-upload-mbps", "0.1"), "--max-upload-mbps"),
        (("--threads", "0"), "--threads"),
        (("--grpc-port", "65536"), "--grpc-port"),
        (("--advertise-host", "0.0.0.0"), "--advertise-host"),
        (("--api-port", "-1"), "--api-port"),
        (("--max-body-kb", "0"), "--max-body-kb"),
        (("--drain-timeout", "-1"), "--drain-timeout"),
        (("--kv-memory-gb", "0"), "--kv-memory-gb"),
        (("--micro-batches", "-1"), "--micro-batches"),
        (("--speculate", "draft"), "--draft-model"),
    ],
)
def test_each_group_refuses_nonsense_naming_the_flag_to_fix(flags, fix):
    with pytest.raises(ValueError, match=fix):
        settings(*flags)


def test_fetch_flags_say_where_models_go_and_cap_uploads(tmp_path):
    f = settings("--models-dir", str(tmp_path), "--max-upload-mbps", "8").fetch
    assert f == FetchSettings(tmp_path, 8.0) and f.upload_rate == 1e6  # bytes per second
    assert settings().fetch.upload_rate is None  # no cap


def test_engine_flags_are_one_setting_with_auto_resolved():
    e = settings("--threads", "3", "--quantize", "q8_0", "--float-matmul", "rowwise").engine
    assert e == EngineSettings("numpy", 3, "q8_0", "rowwise") and e.name == settings().node.engine
    assert e.options == {"threads": 3, "quantize": "q8_0", "float_matmul": "rowwise"}
    assert settings_from_args(parse_args([]), machine=MACHINE).engine.name != "auto"


def test_attention_is_an_engine_option_only_when_given():
    assert settings("--attention", "gemm").engine.options["attention"] == "gemm"
    assert "attention" not in settings().engine.options  # the engine's own default: auto
    with pytest.raises(ValueError, match="--attention must be one of auto, flash, gemm"):
        EngineSettings("ggml", attention="sideways")


def test_only_the_settings_package_reads_flags():
    """Everything below `cli.main` takes typed settings: no module of node/ or discovery/ but node/settings/ (and
    `exo-node keygen`'s own command line) imports argparse."""
    readers = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for package in ("node", "discovery")
        for path in (ROOT / package).rglob("*.py")
        if "argparse" in all_imports(path)
    }
    assert {m for m in readers if not m.startswith("node.settings")} == {"node.security.keys"}
    assert inspect.signature(cli.run).parameters["settings"].annotation == "Settings"
    assert inspect.signature(weight_source).parameters["fetch"].annotation == "FetchSettings"
