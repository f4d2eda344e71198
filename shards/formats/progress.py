"""Progress of long operations (loading a shard's weights, a benchmark's runs).

On a terminal: a tqdm bar on stderr. Anywhere else (a service's journal, CI, a log file) a bar would be a mess of
carriage returns, so a log line every `LOG_EVERY_S` seconds instead, and one closing line saying how long it took.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, TypeVar

log = logging.getLogger(__name__)
LOG_EVERY_S = 5.0
T = TypeVar("T")


class Progress:
    """`with Progress("loading llama", total_bytes) as p: ... p.update(n)`. unit "B" counts bytes (shown as
    KB/MB/GB); any other unit is a plain count."""

    def __init__(
        self,
        desc: str,
        total: int,
        unit: str = "B",
        stream: IO[str] | None = None,
        every: float | None = None,
        logger: logging.Logger = log,
    ):
        self.desc, self.total, self.unit, self.log = desc, total, unit, logger
        self.every = LOG_EVERY_S if every is None else every
        stream = stream or sys.stderr
        self.done = 0
        self.started = self.logged = time.monotonic()
        self.bar = None
        if _is_terminal(stream):
            from tqdm import tqdm  # loaded for a terminal only

            self.bar = tqdm(
                total=total,
                desc=desc,
                unit=unit,
                unit_scale=unit == "B",
                unit_divisor=1024,
                file=stream,
                dynamic_ncols=True,
            )

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.logged >= self.every and self.done < self.total:
            self.logged = now
            percent = 100 * self.done / self.total if self.total else 100
            rate = self.done / max(now - self.started, 1e-9)
            self.log.info(
                "%s: %.0f%% (%s of %s), %.1f s, %s/s, about %.0f s left",
                self.desc,
                percent,
                self._amount(self.done),
                self._amount(self.total),
                now - self.started,
                self._amount(rate),
                (self.total - self.done) / rate if rate else float("inf"),
            )

    def close(self, failed: bool = False) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            return
        seconds = time.monotonic() - self.started
        if failed:
            self.log.info(
                "%s: stopped after %s of %s, %.1f s",
                self.desc,
                self._amount(self.done),
                self._amount(self.total),
                seconds,
            )
        else:
            self.log.info("%s: %s in %.1f s", self.desc, self._amount(self.done), seconds)

    def _amount(self, n: float) -> str:
        if self.unit != "B":
            return f"{n:g} {self.unit}"
        for unit in ("B", "KB", "MB", "GB"):
            if n < 1000 or unit == "GB":
                return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
            n /= 1000
        raise AssertionError("unreachable")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind, error, tb) -> None:
        self.close(failed=kind is not None)


def track(items: Iterable[tuple[T, int]], desc: str, total: int | None = None, **kwargs) -> Iterator[T]:
    """Yield each item of (item, size) pairs, advancing the progress by its size once the caller is done with it."""
    pairs = list(items) if total is None else items
    total = sum(size for _, size in pairs) if total is None else total
    with Progress(desc, total, **kwargs) as progress:
        for item, size in pairs:
            yield item
            progress.update(size)


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False
