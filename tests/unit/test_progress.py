"""Loading weights shows progress: a tqdm bar on a terminal, periodic log lines anywhere else."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import pty
import select
import struct
import sys
import termios

import pytest

from shards.formats import progress
from shards.formats.config import ModelConfig
from shards.formats.loader import load_shard_weights
from shards.formats.progress import Progress, track
from shards.model.shard import Shard
from tests.conftest import FIXTURES

MODEL = FIXTURES / "llama"


def read_all(fd: int) -> str:
    out = b""
    while select.select([fd], [], [], 0.2)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
    return out.decode(errors="replace")


@pytest.fixture
def terminal(monkeypatch):
    """Call it to make stderr a real pseudo-terminal (in the test itself: pytest resets sys.stderr after fixtures
    run); it returns a function that returns what has appeared on that terminal."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))  # 120 columns, like a real one
    stream = os.fdopen(follower, "w", buffering=1)

    def attach():
        monkeypatch.setattr(sys, "stderr", stream)
        return lambda: (stream.flush(), read_all(leader))[1]

    yield attach
    stream.close()
    os.close(leader)


def test_loading_weights_on_a_terminal_draws_a_bar_to_100_percent(terminal, caplog):
    caplog.set_level(logging.INFO, logger="shards.formats.progress")
    screen = terminal()
    cfg = ModelConfig.from_dir(MODEL)
    weights = load_shard_weights(MODEL, cfg, Shard("llama", 0, 3, 6))
    shown = screen()
    assert "loading llama" in shown and "100%" in shown and "\r" in shown  # a bar redrawn in place
    assert f"{weights.nbytes() / 1024:.0f}k/{weights.nbytes() / 1024:.0f}k" in shown  # bytes, in KiB
    assert not caplog.records  # the bar replaces the log lines


def test_loading_weights_elsewhere_logs_lines_every_few_seconds_and_a_closing_one(caplog, monkeypatch):
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)  # every tensor is "a few seconds" later
    caplog.set_level(logging.INFO, logger="shards.formats.progress")
    cfg = ModelConfig.from_dir(MODEL)
    weights = load_shard_weights(MODEL, cfg, Shard("llama", 0, 6, 6))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) > 10 and all(line.startswith("loading llama: ") for line in lines)
    percents = [int(line.split(": ")[1].split("%")[0]) for line in lines[:-1]]
    assert percents == sorted(percents) and percents[-1] < 100 and len(set(percents)) > 5
    assert lines[-1].endswith(" s") and f"{weights.nbytes() / 1e6:.1f} MB in " in lines[-1]


def test_no_periodic_lines_before_the_interval_passes(caplog):
    caplog.set_level(logging.INFO, logger="shards.formats.progress")
    with Progress("copying", 3, unit="files", stream=io.StringIO(), every=60) as p:
        for _ in range(3):
            p.update(1)
    assert [r.getMessage() for r in caplog.records][0].startswith("copying: 3 files in ")
    assert len(caplog.records) == 1


def test_a_failure_is_reported_as_stopped_not_done(caplog):
    caplog.set_level(logging.INFO, logger="shards.formats.progress")
    with pytest.raises(RuntimeError):
        with Progress("loading x", 100, stream=io.StringIO()) as p:
            p.update(40)
            raise RuntimeError("disk gone")
    assert caplog.records[-1].getMessage().startswith("loading x: stopped after 40 B of 100 B")


def test_track_yields_every_item_and_advances_by_its_size(terminal):
    screen = terminal()
    assert list(track([("a", 1), ("b", 2), ("c", 3)], "runs", unit="runs")) == ["a", "b", "c"]
    shown = screen()
    assert "runs" in shown and "6/6" in shown
