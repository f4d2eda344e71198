"""The speed a node reports for placement (node/runtime/calibration.py, in its capabilities: node/grpc/wire_cluster.py):
a short calibration on its engine thread at start, refreshed from live passes, moving the report only by whole
steps, never for a shard's first passes, passes beside other requests or a quota's stalls; under a CPU quota, the
share the node sustains. The placement that uses it: test_placement_speed.py."""

import math

import pytest

from node.core.placement.balance import SPEED_STEP
from node.core.placement.layer_costs import layer_costs, layer_footprints
from node.core.placement.partition import NodeCapacity, partition
from node.core.topology import Capabilities, NodeInfo
from node.grpc.wire import WireError
from node.grpc.wire_cluster import decode_node_info, encode_node_info
from node.runtime.calibration import REPORT_STEPS, LayerSpeed, calibrate, calibration_slice
from shards.engines.numpy_engine import NumpyEngine
from shards.formats.config import ModelConfig
from shards.model.shard import Shard
from tests.support.models import FIXTURES
from tests.unit.test_placement_speed import GB

LLAMA = FIXTURES / "llama"


def test_calibration_times_a_slice_of_the_model_well_under_a_second():
    cfg = ModelConfig.from_dir(LLAMA)
    shard = calibration_slice("llama", cfg.n_layers)
    assert shard.layer_count == 2 and not shard.is_first and not shard.is_last
    speed = calibrate(NumpyEngine, LLAMA, shard, cfg, layer_costs(cfg))
    assert speed is not None and 0 < speed < 1e6


def test_a_node_calibrates_on_its_engine_thread_keeps_its_fastest_round_and_frees_the_engine(monkeypatch):
    import asyncio

    from node.runtime import calibration

    monkeypatch.setattr(calibration, "ROUND_GAP_S", 0.0)
    cfg = ModelConfig.from_dir(LLAMA)
    speed = LayerSpeed(layer_costs(cfg))

    async def on_a_thread(fn, *args):
        return await asyncio.to_thread(fn, *args)

    made = []

    class Observed(NumpyEngine):
        """The numpy engine, noting when it is closed."""

        closed = False

        def close(self):
            self.closed = True
            super().close()

    def factory(*args):
        made.append(Observed(*args))
        return made[-1]

    asyncio.run(calibration.calibrate_node(on_a_thread, factory, LLAMA, "llama", cfg, layer_costs(cfg), speed))
    assert speed.speed > 0
    assert [e.closed for e in made] == [True]  # its weights freed as soon as it is done, not when collected
    fastest = speed.speed
    speed.measured(fastest / 2)  # a round slowed by another process starting
    assert speed.speed == fastest


def test_a_later_calibration_round_moves_the_report_only_when_it_is_steps_faster():
    """The first round runs on an idle node before it joins; a later one a few percent faster would only move a
    layer under the first requests, while one slowed by another process starting is caught by a round steps faster."""
    speed = LayerSpeed((10**9,) * 4)
    speed.measured(10.0)
    speed.measured(10.0 * SPEED_STEP)  # a step faster: noise
    assert speed.speed == 10.0
    speed.measured(10.0 * SPEED_STEP ** (REPORT_STEPS + 0.2))  # the first round was held back
    assert speed.speed > 10.0 * SPEED_STEP**REPORT_STEPS


def test_live_passes_move_the_report_only_when_they_are_steps_away():
    costs = (10**9,) * 4
    speed = LayerSpeed(costs)
    shard = Shard("m", 0, 2, 4)  # 2 Gparam a token
    speed.measured(10.0)
    assert speed.speed == 10.0
    for _ in range(50):
        speed.observed(shard, 1, 2 / 10.5)  # 5% faster: within the quantisation, the report stays
    assert speed.speed == 10.0
    for _ in range(50):
        speed.observed(shard, 1, 2 / 5)  # half speed: the report follows
    near = (5 / SPEED_STEP**REPORT_STEPS, 5 * SPEED_STEP**REPORT_STEPS)  # it moved, and stays until steps away
    assert near[0] < speed.speed < near[1] and speed.speed < 10 / SPEED_STEP**REPORT_STEPS
    reported = speed.speed
    speed.observed(shard, 8, 1e-6)  # a batched pass is not a one-row rate
    assert speed.speed == reported


def test_a_shards_first_passes_and_stray_slow_ones_never_move_the_report():
    """A new shard's first passes touch its weights and build its graphs; one such pass in a mean halved a host's
    report and gave all its layers to the other host. The median of a window of passes ignores them."""
    speed = LayerSpeed((10**9,) * 4)
    speed.measured(10.0)
    for shard in (Shard("m", 0, 2, 4), Shard("m", 0, 3, 4)):  # a shard, then the one the next plan gives
        for slower in (15, 5):  # building graphs, paging weights in
            speed.observed(shard, 1, slower * shard.layer_count / 10)
        for i in range(40):
            speed.observed(shard, 1, shard.layer_count / (10 if i % 4 else 1))  # every fourth pass preempted
    assert speed.speed == 10.0


def test_passes_timed_beside_other_requests_never_move_the_report():
    """Under load a pass's wall time grows with the other requests' work on the core: the ring must not follow it."""
    speed = LayerSpeed((10**9,) * 4)
    shard = Shard("m", 0, 2, 4)
    speed.measured(10.0)
    for _ in range(50):
        speed.observed(shard, 1, 2 / 4, alone=False)  # 2.5x slower, beside 7 other streams
    assert speed.speed == 10.0
    for _ in range(50):
        speed.observed(shard, 1, 2 / 4)  # as slow with the node to itself: it is slower
    assert speed.speed < 10.0 / SPEED_STEP**REPORT_STEPS


def test_under_a_cpu_quota_calibration_and_live_passes_count_at_the_share_the_node_sustains():
    """A quota lets a short pass run at full speed and holds a busy node to its share: a throttled node reporting
    its bursts got more layers than it could carry under load (0.82x of the best split)."""
    shard = Shard("m", 0, 2, 4)
    full, half = LayerSpeed((10**9,) * 4), LayerSpeed((10**9,) * 4, share=0.5)
    for speed in (full, half):
        speed.measured(10.0)  # the calibration's median step: full speed
        for _ in range(50):
            speed.observed(shard, 1, 2 / 10)  # lone passes, unthrottled
    assert (full.speed, half.speed) == (10.0, 5.0)
    for speed in (full, half):
        for _ in range(50):
            speed.observed(shard, 1, 2 / 5)  # the machine got slower: both follow, each at its share
    assert 4 < full.speed < 6 and 2 < half.speed < 3
    with pytest.raises(ValueError, match="share"):
        LayerSpeed((1,), share=0)


def test_calibration_times_full_speed_steps_when_some_wait_out_a_quota_period():
    """Under a quota the step that meets the end of a period's budget waits out the period: the median skips it
    where a mean over the window mixed the two speeds (3.3 to 7.7 Gparam/s between rounds on one host)."""
    import time

    from node.runtime.calibration import time_steps

    cfg = ModelConfig.from_dir(LLAMA)

    class Throttled(NumpyEngine):
        """The numpy engine on a host whose every fourth step is held back for 50 ms."""

        calls = 0

        def forward(self, *args, **kwargs):
            self.calls += 1
            if self.calls % 4 == 0:
                time.sleep(0.05)
            return super().forward(*args, **kwargs)

    shard = Shard("llama", 0, cfg.n_layers, cfg.n_layers)
    plain, throttled = NumpyEngine(LLAMA, shard, cfg), Throttled(LLAMA, shard, cfg)
    assert time_steps(throttled, cfg) < 0.01 + 3 * time_steps(plain, cfg)  # not the ~12 ms a step a mean gives


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_processes_cpu_quota_is_the_tightest_on_its_cgroups_path(tmp_path, version):
    from node.runtime.calibration import cpu_quota, cpu_share

    if version == "v2":
        top, line = tmp_path, "0::/outer/inner\n"
        (top / "outer/inner").mkdir(parents=True)
        (top / "outer/cpu.max").write_text("150000 100000\n")
        (top / "outer/inner/cpu.max").write_text("max 100000\n")
    else:
        top, line = tmp_path / "cpu,cpuacct", "4:memory:/x\n3:cpu,cpuacct:/outer/inner\n"
        (top / "outer/inner").mkdir(parents=True)
        for group, quota in (("outer", "150000"), ("outer/inner", "-1")):
            (top / group / "cpu.cfs_quota_us").write_text(quota)
            (top / group / "cpu.cfs_period_us").write_text("100000")
    cgroups = tmp_path / "cgroup"
    cgroups.write_text(line)
    assert cpu_quota(cgroups, tmp_path) == 1.5
    (top / "outer/inner" / ("cpu.max" if version == "v2" else "cpu.cfs_quota_us")).write_text(
        "50000 100000" if version == "v2" else "50000"
    )
    assert cpu_quota(cgroups, tmp_path) == 0.5
    cgroups.write_text("0::/\n" if version == "v2" else "3:cpu,cpuacct:/\n")
    (top / ("cpu.max" if version == "v2" else "cpu.cfs_quota_us")).write_text("max" if version == "v2" else "-1")
    if version == "v1":
        (top / "cpu.cfs_period_us").write_text("100000")
    assert cpu_quota(cgroups, tmp_path) is None
    assert cpu_share(0.5, 1) == 0.5 and cpu_share(1.0, 2) == 0.5 and cpu_share(4.0, 2) == 1.0


def test_an_operators_speed_is_reported_as_given_and_never_measured():
    speed = LayerSpeed((10**9,) * 4, fixed=3.0)
    speed.measured(100.0)
    speed.observed(Shard("m", 0, 2, 4), 1, 1e-3)
    assert speed.speed == 3.0
    with pytest.raises(ValueError, match="--speed"):
        LayerSpeed((1,), fixed=0)


def info(speed: float) -> NodeInfo:
    return NodeInfo("a", "127.0.0.1:1000", Capabilities(GB, "numpy", "m", 4, speed))


def test_the_speed_travels_with_the_capabilities():
    assert decode_node_info(encode_node_info(info(12.5))).capabilities.speed == 12.5
    assert decode_node_info(encode_node_info(info(0.0))).capabilities.speed == 0.0


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, 1e9])
def test_a_peers_hostile_speed_is_refused(bad):
    m = encode_node_info(info(1.0))
    m.capabilities.speed = bad
    with pytest.raises(WireError, match="speed"):
        decode_node_info(m)


def test_footprints_and_costs_of_a_real_model_place_within_memory():
    cfg = ModelConfig.from_dir(LLAMA)
    feet = layer_footprints(cfg, bytes_per_param=2, kv_tokens=cfg.max_position_embeddings, kv_value_bytes=2)
    small = sum(feet[:2])
    nodes = [NodeCapacity("a", 10 * sum(feet), speed=1), NodeCapacity("b", small, speed=100)]
    ring = partition(nodes, "m", cfg.n_layers, layer_costs(cfg), feet)
    held = {i: sum(feet[s.start_layer : s.end_layer]) for i, s in ring}
    assert held.get("b", 0) <= small  # the fast node takes what its memory allows, no more


def test_the_speed_flag_fixes_what_the_node_reports():
    from node.settings import Machine, parse_args, settings_from_args

    machine = Machine(hostname="box", available_memory=10 * GB, lan_host="192.168.1.7")
    node = settings_from_args(parse_args(["--engine", "numpy", "--speed", "2.5"]), machine=machine).node
    assert node.speed == 2.5
    assert settings_from_args(parse_args(["--engine", "numpy"]), machine=machine).node.speed is None
    with pytest.raises(ValueError, match="--speed"):
        settings_from_args(parse_args(["--engine", "numpy", "--speed", "0"]), machine=machine)
