"""The multi-host benchmark's pure parts: the netem command lines, the counters' arithmetic and the report's table."""

import json
import socket
import threading
import time

import pytest

from bench.delay_relay import Delay, serve
from bench.multihost_lan import EXO_GRPC, EXO_LINK, RPC_PORT, Link, netem_commands, relays, tx_counters
from bench.multihost_report import HOP_KEYS, Figures, outside_ms, per_token, report, table


def test_a_link_puts_its_delay_on_the_hosts_egress_only_and_its_rate_on_both_directions():
    host, port = netem_commands("exo-h0-ab", "exo-sw-ab", "p0", Link(0.2, 1000))
    assert host == "tc -n exo-h0-ab qdisc replace dev eth0 root netem delay 0.2ms rate 1000mbit".split()
    assert port == "tc -n exo-sw-ab qdisc replace dev p0 root netem rate 1000mbit".split()


def test_whole_delays_and_rates_are_written_without_a_decimal_point():
    host, port = netem_commands("h", "sw", "p1", Link(5.0, 100.0))
    assert host[-4:] == ["delay", "5ms", "rate", "100mbit"] and port[-1] == "100mbit"


def test_without_netem_the_rate_is_shaped_by_htb_both_ways_and_no_delay_is_asked_of_tc():
    cmds = netem_commands("h1", "sw", "p1", Link(5, 100), netem=False)
    assert cmds == [
        "tc -n h1 qdisc del dev eth0 root".split(),
        "tc -n h1 qdisc add dev eth0 root handle 1: htb default 1".split(),
        "tc -n h1 class add dev eth0 parent 1: classid 1:1 htb rate 100mbit".split(),
        "tc -n sw qdisc del dev p1 root".split(),
        "tc -n sw qdisc add dev p1 root handle 1: htb default 1".split(),
        "tc -n sw class add dev p1 parent 1: classid 1:1 htb rate 100mbit".split(),
    ]


def test_relays_give_every_host_the_other_exo_nodes_and_their_links_and_the_entry_the_other_rpc_workers():
    ips = ["10.0.0.10", "10.0.0.11", "10.0.0.12"]
    assert relays(ips, 0) == [
        f"127.0.0.1:{EXO_GRPC + 1}=10.0.0.11:{EXO_GRPC + 1}",
        f"127.0.0.1:{EXO_GRPC + 2}=10.0.0.12:{EXO_GRPC + 2}",
        f"127.0.0.1:{EXO_LINK + 1}=10.0.0.11:{EXO_LINK + 1}",
        f"127.0.0.1:{EXO_LINK + 2}=10.0.0.12:{EXO_LINK + 2}",
        f"127.0.0.1:{RPC_PORT + 1}=10.0.0.11:{RPC_PORT + 1}",
        f"127.0.0.1:{RPC_PORT + 2}=10.0.0.12:{RPC_PORT + 2}",
    ]
    assert relays(ips, 2) == [
        f"127.0.0.1:{base + j}=10.0.0.1{j}:{base + j}" for base in (EXO_GRPC, EXO_LINK) for j in (0, 1)
    ]


@pytest.mark.parametrize("delay, rate", [(-1, 100), (1, 0), (1, -5)])
def test_a_link_refuses_a_negative_delay_or_a_rate_that_is_not_positive(delay, rate):
    with pytest.raises(ValueError, match="delay >= 0 ms and a rate > 0"):
        Link(delay, rate)


def test_a_links_label_names_gigabit_rates_in_gbit():
    assert Link(0.2, 1000).label == "0.2 ms, 1 Gbit/s"
    assert Link(5, 100).label == "5 ms, 100 Mbit/s"


def test_tx_counters_read_bytes_and_packets_sent_from_ip_json():
    link = {"ifname": "eth0", "stats64": {"rx": {"bytes": 9, "packets": 1}, "tx": {"bytes": 1500, "packets": 7}}}
    assert tx_counters(json.dumps([link])) == (1500, 7)


def test_traffic_per_token_is_each_hops_difference_over_the_tokens():
    assert per_token([(100, 10), (50, 5)], [(1100, 30), (450, 9)], 4) == [(250.0, 5.0), (100.0, 1.0)]
    with pytest.raises(ValueError, match="no tokens"):
        per_token([(0, 0)], [(1, 1)], 0)


def test_outside_compute_per_hop_is_the_senders_pass_end_to_write_and_the_receivers_handler_to_pass():
    zero = dict.fromkeys(HOP_KEYS, 0)
    a0 = zero | {
        "hop_out_us_total": 200,
        "hop_out": 2,
        "hop_write_us_total": 600,
        "hop_writes": 2,
        "hop_accept_us_total": 100,
        "hop_accepts": 1,
        "hop_in_us_total": 600,
        "hop_in": 2,
        "hop_send_us_total": 9000,  # the call's answer: not on the token's path
        "hop_sends": 2,
    }
    a1 = zero | {"hop_out_us_total": 400, "hop_out": 2, "hop_write_us_total": 200, "hop_writes": 2, "hop_accept_us_total": 300, "hop_accepts": 2, "hop_in_us_total": 300, "hop_in": 2}  # fmt: skip
    hop01, hop10 = outside_ms([zero, zero], [a0, a1])
    assert hop01 == pytest.approx(0.1 + 0.3 + 0.15 + 0.15)  # node 0 sends, node 1 receives
    assert hop10 == pytest.approx(0.2 + 0.1 + 0.1 + 0.3)


def figures(one, eight, outside=(0.4, 0.5)):
    return Figures(one, eight, 120.0, (2400.0, 2300.0), (3.0, 2.5), outside)


def test_the_table_gives_both_systems_exos_ratios_and_whether_each_goal_is_met():
    text = table(Link(1, 1000), 2, figures(30.0, 90.0), figures(25.0, 70.0, outside=None))
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in text.splitlines() if line.startswith("| ")
    }
    assert text.startswith("### 1 ms, 1 Gbit/s, 2 hosts\n")
    assert rows["one stream, decode tok/s"] == ["30.0", "25.0", "1.20x (goal ≥ 1.0x: met) |"]
    assert rows["8 streams, aggregate tok/s"] == ["90.0", "70.0", "1.29x (goal ≥ 1.5x: missed) |"]
    assert rows["bytes per token, h0→h1 / h1→h0"][:2] == ["2400 / 2300", "2400 / 2300"]
    assert rows["node work per token per hop, ms, h0→h1 / h1→h0"][:2] == ["0.40 / 0.50", "—"]


def test_three_hosts_say_beside_their_figures_that_they_share_the_cores():
    three = Figures(10.0, 20.0, 300.0, (1.0, 2.0, 3.0), (1.0, 1.0, 1.0), None)
    text = report([(Link(5, 100), three, three)], 3, "uv run python -m bench.bench_multihost --hosts 3", 1.0)
    assert "### 5 ms, 100 Mbit/s, 3 hosts (3 hosts share the 2 cores)" in text
    assert "share the machine's 2 cores" in text and "`uv run python -m bench.bench_multihost --hosts 3`" in text


def test_a_keyed_run_says_that_the_nodes_talk_mutual_tls_and_a_keyless_one_does_not():
    two = Figures(10.0, 20.0, 300.0, (1.0, 2.0), (1.0, 1.0), None)
    keyed = report([(Link(1, 1000), two, two)], 2, "bench_multihost --cluster-key", 1.0, keyed=True)
    plain = report([(Link(1, 1000), two, two)], 2, "bench_multihost", 1.0)
    assert "share a cluster key" in keyed and "mutual TLS" in keyed
    assert "cluster key" not in plain


def test_figures_need_one_byte_and_one_packet_figure_per_hop():
    with pytest.raises(ValueError, match="one figure per hop"):
        Figures(1.0, 1.0, 1.0, (1.0, 2.0), (1.0,), None)


def test_the_relay_passes_bytes_intact_each_way_and_never_sooner_than_its_delay(tmp_path):
    (tmp_path / "delay_ms").write_text("30")
    delay = Delay(tmp_path / "delay_ms")
    target, relay = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=serve, args=(relay, target.getsockname(), delay), daemon=True).start()
    with socket.create_connection(relay.getsockname(), timeout=10) as client:
        sent = time.perf_counter()
        client.sendall(b"ping" * 1000)
        far, _ = target.accept()
        got = b""
        while len(got) < 4000:
            got += far.recv(4096)
        arrived = time.perf_counter()
        far.sendall(b"pong")
        assert client.recv(4) == b"pong" and got == b"ping" * 1000
        assert arrived - sent >= 0.03 and time.perf_counter() - sent >= 0.06
        far.close()
