"""This node's layer throughput, which placement balances (node/core/placement/balance.py): billions of parameters
a token goes through per second on one row, reported in its capabilities.

Measured twice over:
- at start (`calibrate_node`): one-row forward steps through an engine on a slice of the model's layers, back to
  back for WINDOW_S, their median timed; ROUNDS times, ROUND_GAP_S apart, the fastest kept, since other processes
  starting at the same time only ever slow a round. The first round runs before the node joins its peers, so the
  first plan that counts it has its speed, and the round runs with no shard loading beside it. With it, what the
  output head costs here (`measure_head`: the model's last layers with the head against the middle ones), which
  placement weighs the last node's share by (node/core/placement/layer_costs.py);
- then from the live passes (`LayerSpeed.observed`): the median of recent one-row passes' compute times over their
  shard's cost.
What is reported moves only when a measure is REPORT_STEPS quantisation steps away from it, so measurement noise
never moves a layer; an operator's --speed fixes it and nothing is measured.

Both report what the node sustains. A CPU quota (a cgroup's, as containers and `systemd` limits set) lets a short
pass run at full speed and throttles a busy node to its share: both measures time passes at full speed and scale
them by the node's CPU share (`cpu_share`), else a lightly loaded throttled node reports its burst speed, gets more
layers, and the ring waits for it under load.
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import numpy as np

from node.core.placement.balance import MAX_SPEED, speed_level
from node.core.placement.layer_costs import MAX_HEAD_WEIGHT, block_costs, head_params, layer_costs
from shards.engines.base import Engine, StepInput
from shards.formats.config import ModelConfig
from shards.model.shard import Shard

log = logging.getLogger(__name__)

WARMUP_STEPS = 2  # the first passes build graphs and touch the weights: not timed
MIN_STEPS = 3  # timed steps at least, however long they take
WINDOW_S = 0.3  # steps run back to back this long (their median is timed)
SLICE_LAYERS = 2  # the layers of the engine it times
ROUNDS = 3  # calibration windows at start ...
ROUND_GAP_S = 2.0  # ... this far apart
IDLE_POLL_S = 1.0  # under --speed, how often the node looks for an idle engine of its own to price drafts on
LIVE_WINDOW = 16  # live passes whose median is the live measure ...
MIN_LIVE = 8  # ... once it holds this many
REPORT_STEPS = 2  # the report moves when the measure is this many quantisation steps away from it
DRAFT_ROWS = 3  # draft rows timed beside one (`draft_row_cost`): proposals are 1-4 tokens


def calibration_slice(model_id: str, n_layers: int) -> Shard:
    """The layers timed at start: SLICE_LAYERS from the middle (no embedding, and no head unless they are the
    model's last), the whole model when it has no more."""
    if n_layers <= SLICE_LAYERS:
        return Shard(model_id, 0, n_layers, n_layers)
    start = (n_layers - SLICE_LAYERS) // 2
    return Shard(model_id, start, start + SLICE_LAYERS, n_layers)


def head_slice(model_id: str, n_layers: int) -> Shard | None:
    """The layers timed with the head: the model's last SLICE_LAYERS (None when the calibration slice is the whole
    model: nothing to tell the head from)."""
    if n_layers <= SLICE_LAYERS:
        return None
    return Shard(model_id, n_layers - SLICE_LAYERS, n_layers, n_layers)


def head_weight_of(config: ModelConfig, mid: Shard, mid_seconds: float, last: Shard, last_seconds: float) -> float:
    """What a head parameter costs in layer parameters, from one-row steps through the middle slice and through the
    last layers with the head: the head's time is the difference, less the layers' own (at the middle's time per
    parameter); to 1/16, between 1/16 and MAX_HEAD_WEIGHT."""
    layers = block_costs(config)
    per_param = mid_seconds / sum(layers[mid.start_layer : mid.end_layer])
    head_seconds = last_seconds - per_param * sum(layers[last.start_layer : last.end_layer])
    weight = head_seconds / per_param / head_params(config)
    return min(max(round(weight * 16), 1) / 16, MAX_HEAD_WEIGHT)


async def measure_head(
    run: Callable[..., Awaitable],
    factory,
    model_dir: Path,
    config: ModelConfig,
    mid: Shard,
    mid_engine: Engine,
) -> float | None:
    """`head_weight_of` on this node: an engine on `head_slice` and the middle slice's timed step for step
    (`time_interleaved`: nodes starting together load each other's cores unevenly); None for a model with no more
    layers than a slice."""
    last = head_slice(mid.model_id, config.n_layers)
    if last is None:
        return None
    engine = await run(factory, model_dir, last, config)
    try:
        mid_seconds, last_seconds = await run(time_interleaved, [mid_engine, engine], config)
    finally:
        await run(engine.close)
    if not (mid_seconds and last_seconds):
        return None
    return head_weight_of(config, mid, mid_seconds, last, last_seconds)


async def calibrate_node(
    run: Callable[..., Awaitable],
    factory,
    model_dir: Path,
    model_id: str,
    config: ModelConfig,
    costs: Sequence[int],
    speed: LayerSpeed,
    complete: Callable[[], bool] = lambda: True,
    first: asyncio.Event | None = None,
    head: bool = False,
    drafts: Callable[[float], None] | None = None,
) -> None:
    """Once the node holds every layer (`complete`; one holding only some measures as it serves), unless --speed
    fixes the speed: ROUNDS calibrations of one engine on `calibration_slice`, through `run` (the engine thread),
    each reported to `speed` (which keeps the fastest), and with `head` (the engine holds the head in another type
    than the layers), after the first, what the head costs (`measure_head`: about a second more before the node
    joins; a head of the layers' type costs what its parameters say). `first` is set at the first round, or as soon
    as there will be none: a failure leaves the node to be counted as the others until its live passes measure it.
    With the second round (the node serves by then), `drafts` is told what a draft row costs (`draft_row_cost`),
    until then drafts count as free, as where weights are read. Under --speed nothing is built here: the node prices
    its drafts on the engine it serves with (`price_drafts_on`), since a slice's weights would be memory the planner
    never counted (a 7B's two layers are 240 MB)."""
    fixed = speed.fixed is not None
    try:
        if fixed:
            return
        while not complete():
            await asyncio.sleep(1.0)
        shard = calibration_slice(model_id, config.n_layers)
        engine = await run(factory, model_dir, shard, config)
        try:
            for i in range(ROUNDS):
                if i:
                    await asyncio.sleep(ROUND_GAP_S)
                await _speed_round(run, factory, model_dir, config, costs, speed, shard, engine, head and i == 0)
                if first is not None:
                    first.set()
                if drafts is not None and i == 1 and (cost := await run(draft_row_cost, engine, config)) is not None:
                    drafts(cost)
                    log.info("a draft row costs %.2f of a one-row step here (%s)", cost, shard)
        finally:  # now, not when a collection finds it: its weights are a slice of the model's memory
            await run(engine.close)
        log.info("calibrated: %.3g Gparam/s (%s)", speed.speed, shard)
    except Exception as e:
        log.warning("no speed calibration: %s", e)
    finally:
        if first is not None:
            first.set()


async def price_drafts_on(
    run: Callable[..., Awaitable],
    own: Callable[[], Engine | None],
    config: ModelConfig,
    drafts: Callable[[float], None],
) -> None:
    """`drafts` told what a draft row costs (`draft_row_cost`, through `run`: the engine thread) on the engine `own()`
    gives (a node under --speed: the first shard it loads), once it gives one that holds no request: its steps
    (a second or two on a 7B's shard) never hold up a request's."""
    while (engine := own()) is None or engine.active_requests > 0:
        await asyncio.sleep(IDLE_POLL_S)
    if (cost := await run(draft_row_cost, engine, config)) is not None:
        drafts(cost)
        log.info("a draft row costs %.2f of a one-row step here (%s)", cost, engine.shard)


async def _speed_round(run, factory, model_dir, config, costs, speed, shard, engine, head: bool) -> None:
    """One calibration round's speed, and with `head` what the head costs (before the node joins: the first plan
    counting it weighs the head by what it measures)."""
    seconds = await run(time_steps, engine, config)
    speed.measured(sum(costs[shard.start_layer : shard.end_layer]) / seconds / 1e9 if seconds else None)
    if head and seconds:
        weight = await measure_head(run, factory, model_dir, config, shard, engine)
        if weight is not None:
            speed.head_measured(weight, layer_costs(config, weight))


def calibrate(factory, model_dir: Path, shard: Shard, config: ModelConfig, costs: Sequence[int]) -> float | None:
    """On the engine thread: build an engine for `shard` (`factory`, as the node builds its own), time one-row
    steps through it and drop it. Billions of parameters per second, or None when nothing was timed."""
    began = time.perf_counter()
    engine = factory(model_dir, shard, config)
    try:
        seconds = time_steps(engine, config)
    finally:
        engine.close()
    if seconds is None:
        return None
    speed = sum(costs[shard.start_layer : shard.end_layer]) / seconds / 1e9
    log.info("calibrated: %.3g Gparam/s (%s, %.0f ms)", speed, shard, (time.perf_counter() - began) * 1e3)
    return min(speed, MAX_SPEED)


def time_steps(engine: Engine, config: ModelConfig) -> float | None:
    """Seconds per one-row decode step at full speed: the median of steps run back to back for WINDOW_S (at least
    MIN_STEPS, after WARMUP_STEPS), each at the same position (the cache rolled back: every step costs the same).
    The median, since under a CPU quota the step that meets the end of a period's budget waits out the period (a
    mean over the window is then a mixture of the two speeds, anywhere from one to the other); `LayerSpeed` scales
    it to what the node sustains."""
    return time_interleaved([engine], config)[0]


def time_interleaved(engines: Sequence[Engine], config: ModelConfig) -> list[float]:
    """`time_steps` of each engine, their steps taken in turn (one of each, again and again): whatever else runs
    on the machine meanwhile slows them alike, so their ratio holds where two windows one after the other would
    each catch another load."""
    return time_in_turn([(engine, 1) for engine in engines], config)


def draft_row_cost(engine: Engine, config: ModelConfig, drafts: int = DRAFT_ROWS) -> float | None:
    """What a draft row adds to a decode step on this engine, as a share of a one-row step: steps of one row and
    of 1 + `drafts` taken in turn, (t(1 + drafts) - t(1)) / (drafts * t(1)) of their medians, at least 0. Near 0
    where a step's time is reading its weights (float weights on a CPU, a GPU: the rows share the read), near 1
    where it is the arithmetic (quantized weights on few cores); speculation's proposals pay only above it
    (shards/decoding/speculation.py DraftLength)."""
    one, more = time_in_turn([(engine, 1), (engine, 1 + drafts)], config)
    return max(0.0, (more - one) / (drafts * one)) if one > 0 else None


def time_in_turn(kinds: Sequence[tuple[Engine, int]], config: ModelConfig) -> list[float]:
    """Median seconds of a step of each (engine, rows), at the same positions every time (the cache rolled back
    to one position), one step of each kind in turn for WINDOW_S (at least MIN_STEPS, after WARMUP_STEPS)."""
    rng = np.random.default_rng(0)
    rids = [f"calibration-{uuid.uuid4().hex}" for _ in kinds]
    hidden = [rng.standard_normal((rows, config.hidden_size)).astype(np.float32) for _, rows in kinds]

    def step(kind: int, i: int) -> None:
        engine, rows = kinds[kind]
        if engine.shard.is_first:
            tokens = (np.arange(i, i + rows) % config.vocab_size).astype(np.int64)
            row = StepInput(rids[kind], tokens=tokens, max_positions=rows + 1)
        else:
            row = StepInput(rids[kind], hidden=hidden[kind], max_positions=rows + 1)
        if i:
            engine.rollback(rids[kind], 1)
        engine.forward([row])

    try:
        for i in range(WARMUP_STEPS):
            for kind in range(len(kinds)):
                step(kind, i)
        began, times = time.perf_counter(), [[] for _ in kinds]
        while len(times[0]) < MIN_STEPS or time.perf_counter() - began < WINDOW_S:
            for kind, took in enumerate(times):
                t = time.perf_counter()
                step(kind, 1 + len(took))
                took.append(time.perf_counter() - t)
        return [float(np.median(took)) for took in times]
    finally:
        for (engine, _), rid in zip(kinds, rids):
            engine.release(rid)


def cpu_quota(cgroups: Path = Path("/proc/self/cgroup"), mount: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The cores this process may use over time by its cgroups' CPU quotas (v2 `cpu.max`; v1 `cpu.cfs_quota_us`
    over `cpu.cfs_period_us`), the tightest from its group up to the root; None without one (or unreadable)."""
    tightest = None
    try:
        lines = cgroups.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",")
        if controllers == "":
            top = mount  # v2: one hierarchy
        elif "cpu" in names:
            top = next((mount / n for n in (controllers, "cpu", "cpu,cpuacct") if (mount / n).is_dir()), None)
        else:
            continue
        group = None if top is None else top / path.lstrip("/")
        while group is not None and group.is_relative_to(top):
            cores = _quota_of(group)
            if cores is not None:
                tightest = cores if tightest is None else min(tightest, cores)
            group = group.parent if group != top else None
    return tightest


def _quota_of(group: Path) -> float | None:
    try:
        if (group / "cpu.max").exists():
            quota, period = (group / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if (group / "cpu.cfs_quota_us").exists():
            quota = int((group / "cpu.cfs_quota_us").read_text())
            return None if quota < 0 else quota / int((group / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None


def cpu_share(quota: float | None = None, cpus: int | None = None) -> float:
    """The share of its CPUs this process sustains: its quota (`cpu_quota()` unless given) over the CPUs it may run
    on (the engine's threads fill them, its default); 1 without a quota."""
    quota = cpu_quota() if quota is None else quota
    if quota is None:
        return 1.0
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(1.0, quota / max(cpus, 1))


class LayerSpeed:
    """What this node reports as its speed: fixed (--speed), else calibrated, then moved by live passes (their
    times over `share`, the CPU share the node sustains: see the module docstring)."""

    def __init__(self, costs: Sequence[int], fixed: float | None = None, share: float = 1.0):
        if fixed is not None and not 0 < fixed <= MAX_SPEED:
            raise ValueError(f"--speed must be in (0, {MAX_SPEED:g}] billion parameters per second, got {fixed}")
        if not 0 < share <= 1:
            raise ValueError(f"a CPU share is in (0, 1], got {share}")
        self.share = share
        self.costs, self.fixed = tuple(costs), fixed
        self.speed = fixed or 0.0  # reported; 0: not measured yet
        self.head_weight = 0.0  # reported: what a head parameter costs in layer parameters here; 0: not measured
        self._shard: Shard | None = None  # the shard the live window times ...
        self._passes = 0  # ... its one-row passes seen (the first WARMUP_STEPS are not timed) ...
        self._window: deque[float] = deque(maxlen=LIVE_WINDOW)  # ... and the last ones' Gparam/s, sustained

    def measured(self, speed: float | None) -> None:
        """A calibration's result (full speed: the node's CPU share scales it): reported at once when it is the
        first, or REPORT_STEPS quantisation steps faster than the report (a round slowed by something else
        running: a later round a step faster would only move a layer back and forth), unless --speed fixes it."""
        speed = None if speed is None else min(speed * self.share, MAX_SPEED)
        if self.fixed is not None or speed is None or not speed > 0:
            return
        if self.speed == 0 or speed_level(speed) - speed_level(self.speed) >= REPORT_STEPS:
            self._report(speed, "calibrated")

    def head_measured(self, weight: float, costs: Sequence[int]) -> None:
        """The head's cost as calibration measured it, and the layer costs with it (a last shard's live passes are
        timed against them)."""
        log.info("head weight %.3g layer parameters a parameter (measured)", weight)
        self.head_weight, self.costs = weight, tuple(costs)

    def observed(self, shard: Shard, positions: int, seconds: float, alone: bool = True) -> None:
        """A pass's compute time: one-row passes of a node's only request, after a shard's first WARMUP_STEPS
        (which touch its weights and build its graphs: in a mean, one such pass could move the report alone),
        are kept in a window of the last LIVE_WINDOW; once MIN_LIVE are, their median moves the report when
        it is REPORT_STEPS quantisation steps away. With other requests in flight their HTTP, sampling and
        transport work share the core, so a pass's wall time grows though the layers are no slower: timed then,
        the report followed the load and moved the ring under it, three times in 16 s under 8 streams."""
        if self.fixed is not None or positions != 1 or not alone or not seconds > 0:
            return
        if shard != self._shard:
            self._shard, self._passes = shard, 0
            self._window.clear()
        self._passes += 1
        if self._passes <= WARMUP_STEPS:
            return
        self._window.append(sum(self.costs[shard.start_layer : shard.end_layer]) / 1e9 * self.share / seconds)
        live = min(statistics.median(self._window), MAX_SPEED)  # every pass: numpy's is slow on 16 numbers
        if len(self._window) >= MIN_LIVE and (
            self.speed == 0 or abs(speed_level(live) - speed_level(self.speed)) >= REPORT_STEPS
        ):
            self._report(live, "from live passes")

    def _report(self, speed: float, why: str) -> None:
        log.info("speed %.3g Gparam/s, %s (was %.3g)", speed, why, self.speed)
        self.speed = speed
