"""This node's layer throughput, which placement balances (node/core/placement/balance.py): billions of parameters
a token goes through per second on one row, reported in its capabilities.

Measured twice over: at start (`calibrate_node`: one-row forward steps through an engine on a slice of the
model's layers, back to back for WINDOW_S: the sustained rate, as a CPU quota allows it; ROUNDS times, ROUND_GAP_S
apart, the fastest kept, since other processes starting at the same time only ever slow a round), then from the live passes (`LayerSpeed.observed`: every one-row
pass's compute time over its shard's cost, smoothed). What is reported moves only when the smoothed measure is
REPORT_STEPS quantisation steps away from it, so measurement noise never moves a layer; an operator's --speed
fixes it and nothing is measured.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import numpy as np

from node.core.placement.balance import MAX_SPEED, speed_level
from shards.engines.base import Engine, StepInput
from shards.formats.config import ModelConfig
from shards.model.shard import Shard

log = logging.getLogger(__name__)

WARMUP_STEPS = 2  # the first passes build graphs and touch the weights: not timed
MIN_STEPS = 3  # timed steps at least, however long they take
WINDOW_S = 0.3  # steps run back to back this long: three periods of a cgroup CPU quota's default 100 ms
SLICE_LAYERS = 2  # the layers of the engine it times
ROUNDS = 3  # calibration windows at start ...
ROUND_GAP_S = 2.0  # ... this far apart
SMOOTHING = 0.1  # weight of a live pass in the smoothed measure
MIN_LIVE = 8  # live passes seen before they may move the report
REPORT_STEPS = 2  # the report moves when the measure is this many quantisation steps away from it


def calibration_slice(model_id: str, n_layers: int) -> Shard:
    """The layers timed at start: SLICE_LAYERS from the middle (no embedding, and no head unless they are the
    model's last), the whole model when it has no more."""
    if n_layers <= SLICE_LAYERS:
        return Shard(model_id, 0, n_layers, n_layers)
    start = (n_layers - SLICE_LAYERS) // 2
    return Shard(model_id, start, start + SLICE_LAYERS, n_layers)


async def calibrate_node(
    run: Callable[..., Awaitable],
    factory,
    model_dir: Path,
    model_id: str,
    config: ModelConfig,
    costs: Sequence[int],
    speed: LayerSpeed,
) -> None:
    """ROUNDS calibrations of one engine on `calibration_slice`, through `run` (the engine thread), each reported
    to `speed` (which keeps the fastest)."""
    shard = calibration_slice(model_id, config.n_layers)
    engine = await run(factory, model_dir, shard, config)
    try:
        for i in range(ROUNDS):
            if i:
                await asyncio.sleep(ROUND_GAP_S)
            seconds = await run(time_steps, engine, config)
            speed.measured(sum(costs[shard.start_layer : shard.end_layer]) / seconds / 1e9 if seconds else None)
    finally:  # now, not when a collection finds it: its weights are a slice of the model's memory
        await run(engine.close)
    log.info("calibrated: %.3g Gparam/s (%s)", speed.speed, shard)


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
    """Seconds per one-row decode step, on average over steps run back to back for WINDOW_S (at least MIN_STEPS,
    after WARMUP_STEPS), each at the same position (the cache rolled back: every step costs the same)."""
    rid = f"calibration-{uuid.uuid4().hex}"
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((1, config.hidden_size)).astype(np.float32)

    def step(i: int) -> None:
        if engine.shard.is_first:
            row = StepInput(rid, tokens=np.array([i % config.vocab_size], np.int64), max_positions=2)
        else:
            row = StepInput(rid, hidden=hidden, max_positions=2)
        if i:
            engine.rollback(rid, 1)
        engine.forward([row])

    try:
        for i in range(WARMUP_STEPS):
            step(i)
        began, steps = time.perf_counter(), 0
        while steps < MIN_STEPS or time.perf_counter() - began < WINDOW_S:
            step(1 + steps)
            steps += 1
        return (time.perf_counter() - began) / steps
    finally:
        engine.release(rid)


class LayerSpeed:
    """What this node reports as its speed: fixed (--speed), else calibrated, then moved by live passes."""

    def __init__(self, costs: Sequence[int], fixed: float | None = None):
        if fixed is not None and not 0 < fixed <= MAX_SPEED:
            raise ValueError(f"--speed must be in (0, {MAX_SPEED:g}] billion parameters per second, got {fixed}")
        self.costs, self.fixed = tuple(costs), fixed
        self.speed = fixed or 0.0  # reported; 0: not measured yet
        self._smoothed: float | None = None  # seconds per billion parameters
        self._seen = 0

    def measured(self, speed: float | None) -> None:
        """A calibration's result: reported at once when it is the first or faster than the last (unless --speed
        fixes it)."""
        if self.fixed is None and speed is not None and speed > 0 and min(speed, MAX_SPEED) > self.speed:
            self.speed = min(speed, MAX_SPEED)
            self._smoothed, self._seen = 1 / self.speed, MIN_LIVE

    def observed(self, shard: Shard, positions: int, seconds: float, alone: bool = True) -> None:
        """A pass's compute time: one-row passes of a node's only request move the smoothed measure, and the report
        once it is REPORT_STEPS quantisation steps away. With other requests in flight their HTTP, sampling and
        transport work share the core, so a pass's wall time grows though the layers are no slower: timed then, the
        report followed the load and moved the ring under it, three times in 16 s under 8 streams."""
        if self.fixed is not None or positions != 1 or not alone or not seconds > 0:
            return
        per_g = seconds / (sum(self.costs[shard.start_layer : shard.end_layer]) / 1e9)
        self._smoothed = per_g if self._smoothed is None else (1 - SMOOTHING) * self._smoothed + SMOOTHING * per_g
        self._seen += 1
        live = min(1 / self._smoothed, MAX_SPEED)
        if self._seen >= MIN_LIVE and (
            self.speed == 0 or abs(speed_level(live) - speed_level(self.speed)) >= REPORT_STEPS
        ):
            self.speed = live
