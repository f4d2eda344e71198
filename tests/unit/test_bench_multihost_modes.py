"""The pure parts of the multi-host benchmark's other modes: the static splits the placement mode tries and its
report, the large-model mode's shares and report, the hosts' caps, and the large model's F16 file."""

import gguf
import numpy as np
import pytest

from bench.bench_multihost_large import GOAL, HostMemory, SystemRun, report, rpc_shares, share_bytes
from bench.bench_multihost_placement import Outcome, Split, planned_split, static_splits
from bench.bench_multihost_placement import report as placement_report
from bench.large_model import LARGE, f16_bytes, tensor_shapes, write_f16
from bench.multihost_lan import MemoryCap, joined, resident


def test_two_hosts_try_every_boundary_between_the_first_and_the_last_layer():
    splits = static_splits(30, 2)
    assert len(splits) == 29
    assert splits[0].ranges == ((0, 1), (1, 30)) and splits[-1].ranges == ((0, 29), (29, 30))


def test_a_step_keeps_only_boundaries_on_its_multiples():
    assert [s.label for s in static_splits(30, 2, step=10)] == ["0:10 / 10:30", "0:20 / 20:30"]


def test_three_hosts_try_every_pair_of_boundaries_each_split_tiling_the_layers():
    splits = static_splits(30, 3)
    assert len(splits) == 29 * 28 // 2
    assert all(s.ranges[0][0] == 0 and s.ranges[-1][1] == 30 for s in splits)


@pytest.mark.parametrize("ranges", [((0, 10), (11, 30)), ((1, 10), (10, 30)), ((0, 10), (10, 10), (10, 30))])
def test_a_split_refuses_ranges_with_a_gap_an_overlap_or_an_empty_range(ranges):
    with pytest.raises(ValueError):
        Split(ranges)


def test_a_split_reads_the_shard_flags_it_prints_and_says_the_form_when_it_cannot():
    assert Split.parse("0:19/19:30") == Split(((0, 19), (19, 30)))
    with pytest.raises(ValueError, match="like 0:19/19:30"):
        Split.parse("0-19/19:30")
    with pytest.raises(ValueError, match="not START:END"):
        Split.parse("0:19:30")


def test_the_planners_split_is_read_off_the_plan_with_a_left_out_host_shown_as_a_dash():
    topo = {"plan": [{"node_id": "host0", "start": 0, "end": 30}]}
    split = planned_split(topo, 2)
    assert split.ranges == ((0, 30), None) and split.label == "0:30 / —"


def test_the_placement_report_gives_planner_over_best_static_and_marks_both_rows():
    planner = Outcome(Split(((0, 20), (20, 30))), (57.0, 59.0), (1.0, 0.5))
    statics = [
        Outcome(Split(((0, 10), (10, 30))), (30.0,)),
        Outcome(Split(((0, 20), (20, 30))), (60.0,)),
        Outcome(Split(((0, 25), (25, 30))), (50.0,)),
    ]
    text = placement_report(planner, statics, "# head")
    assert "Planner / best static split (0:20 / 20:30): 0.97x (goal ≥ 0.9x: met)" in text
    assert "| 0:20 / 20:30 | 60.0 | best static, the planner's split |" in text
    assert "| planner: 0:20 / 20:30 | 58.0 | measured speeds 1.00 / 0.50 Gparam/s |" in text
    worse = placement_report(Outcome(planner.split, (40.0,)), statics, "# head")
    assert "0.67x (goal ≥ 0.9x: missed)" in worse


def test_an_outcome_needs_a_measured_turn():
    with pytest.raises(ValueError, match="no measured turn"):
        Outcome(Split(((0, 30),)), ())


def test_a_hosts_share_is_its_blocks_with_the_embedding_first_and_the_head_last():
    tensors = {"token_embd.weight": 100, "output_norm.weight": 1, "output.weight": 50}
    tensors |= {f"blk.{i}.{t}.weight": 10 for i in range(12) for t in ("attn_q", "ffn_up")}
    assert share_bytes(tensors, 0, 4, 12) == 100 + 4 * 20
    assert share_bytes(tensors, 4, 10, 12) == 6 * 20  # blk.1 is not blk.10's prefix, nor blk.11's
    assert share_bytes(tensors, 10, 12, 12) == 2 * 20 + 51
    assert sum(share_bytes(tensors, a, b, 12) for a, b in ((0, 4), (4, 10), (10, 12))) == sum(tensors.values())


def test_rpc_shares_are_read_from_llama_servers_model_buffer_lines():
    log = (
        "load_tensors: RPC0[127.0.0.1:50100] model buffer size =  1500.50 MiB\n"
        "load_tensors: RPC1[10.231.85.11:50101] model buffer size =   100.00 MiB\n"
        "load_tensors:   CPU_Mapped model buffer size =    70.31 MiB\n"
    )
    assert rpc_shares(log) == {"127.0.0.1:50100": round(1500.5 * 2**20), "10.231.85.11:50101": 100 * 2**20}


def test_the_large_report_judges_exo_by_its_worst_host_and_gives_both_systems_speeds():
    gib = 2**30
    exo = SystemRun(
        "exo-node",
        ({"streams": 1, "per_stream": 2.0, "aggregate": 2.0},),
        (
            HostMemory(0, "node, layers 0:11", gib, gib, int(1.05 * gib), planned=int(1.25 * gib)),
            HostMemory(1, "node", gib, gib, 2 * gib),
        ),
    )
    rpc = SystemRun("llama.cpp RPC", ({"streams": 1, "per_stream": 1.5, "aggregate": 1.5},), ())
    text = report([exo, rpc], 4 * gib, "# head", [1])
    assert f"2.00x (goal ≤ {GOAL:.1f}x: missed)" in text
    assert "| one stream, decode tok/s | 2.00 | 1.50 |" in text
    assert "| exo-node | 0 | node, layers 0:11 | 1.00 | 1.00 | 1.05 | 1.05x | 1.25 |" in text
    assert "| exo-node | 1 | node | 1.00 | 1.00 | 2.00 | 2.00x | — |" in text


def test_resident_memory_is_read_from_proc_status_in_bytes():
    assert resident("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n") == (1024 * 1024, 2048 * 1024)
    with pytest.raises(ValueError, match="VmRSS and VmHWM"):
        resident("Name:\tzombie\n")


def test_a_capped_command_joins_every_group_before_it_becomes_the_command(tmp_path):
    cmd = joined(["ip", "netns", "exec", "h0", "python"], [tmp_path / "cpu", tmp_path / "mem"])
    assert cmd[:2] == ["sh", "-c"] and cmd[4:] == ["ip", "netns", "exec", "h0", "python"]
    assert cmd[2] == f'echo $$ > {tmp_path}/cpu/cgroup.procs && echo $$ > {tmp_path}/mem/cgroup.procs && exec "$@"'
    assert joined(["python"], []) == ["python"]


def test_a_memory_cap_must_be_positive():
    with pytest.raises(ValueError, match="must be positive"):
        MemoryCap(0)


def test_the_large_model_is_7b_shaped():
    params = sum(int(np.prod(s)) for _, s in tensor_shapes(LARGE))
    assert 7.2e9 < params < 7.3e9
    assert len(list(tensor_shapes(LARGE))) == 2 + 9 * 32 + 1
    assert f16_bytes(LARGE) == 2 * params + 2 * 4096 * (2 * 32 + 1)  # norms stay F32


def test_the_f16_file_holds_every_tensor_with_its_shape_and_type(tmp_path):
    tiny = dict(LARGE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, vocab_size=300)  # fmt: skip
    reader = gguf.GGUFReader(write_f16(tmp_path / "tiny.gguf", tiny))
    got = {t.name: (tuple(int(d) for d in t.shape[::-1]), t.tensor_type) for t in reader.tensors}
    want = {n: (s, gguf.GGMLQuantizationType.F32 if len(s) == 1 else gguf.GGMLQuantizationType.F16)
            for n, s in tensor_shapes(tiny)}  # fmt: skip
    assert got == want
    assert int(reader.fields["llama.block_count"].contents()) == 2
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    assert np.isfinite(q.data).all() and 0.5 < float(np.std(q.data.astype(np.float32))) * 8 < 2  # ~1/sqrt(64)
