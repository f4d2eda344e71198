"""Where a node's time goes outside its engine, as always-on status counters (a clock read or two per pass and
per call: nothing measurable), so a benchmark can read them from /v1/topology (bench/bench_overhead.py).

- `outside_us_total` / `outside_passes`: from the end of one pass on the engine thread to the start of the next,
  less the time the worker waited for work to arrive. On a one-node ring at one stream that is the whole Python
  cost of a token (the hand-offs, the core, the sampling's bookkeeping, the HTTP write on the same loop); at 8
  streams, of a step.
- A hop, in the order a token lives it; each `*_us_total` has its count beside it:
  - `loop_wake` (`loop_wakes`): a pass ended on the engine thread -> the event loop applies it;
  - `hop_out`: a pass ended -> its activations' transport call (the loop's wake, the core's routing, the outbox),
    or their write where the engine thread wrote them itself (node/runtime/early_send.py: `hop_write` is then 0);
  - `hop_write` (`hop_writes`): the call -> its message encoded and handed to gRPC's write;
  - `hop_send` (`hop_sends`): the call -> the peer's answer (the write, the link both ways, the peer's taking it);
  - on the peer, `hop_accept` (`hop_accepts`): the message in its handler -> accepted by its core (decoding);
  - `hop_in`: accepted -> the start of the pass that ran it, which is `hop_queue` (`hop_queued`: accepted -> the
    pass handed to the engine thread: waking the worker, scheduling) and `engine_wake` (`engine_wakes`: handed ->
    started).
  What none of them covers is gRPC's own layers and the link between the write and the peer's handler
  (bench_overhead's `--only floor` measures that floor between two bare processes).
- `cpu_outside_us_total` / `cpu_engine_us_total` / `cpu_passes`: CPU time (the kernel's clocks, which count only
  time on a CPU, so they keep their meaning on a loaded machine where wall-clock gaps do not) between two passes'
  ends: the whole process's less the engine thread's, and the engine thread's. On a node with one core nothing
  overlaps, so the first is what each pass pays outside the engine (the event loop, gRPC's threads, the core).
"""

from __future__ import annotations

import time
from collections import Counter


class Overhead:
    def __init__(self, counters: Counter[str]):
        self.counters = counters
        self.last_end: float | None = None  # when the engine thread finished the last pass (perf_counter)
        self._idle = 0.0
        self._arrivals: list[float] = []
        self._submitted: float | None = None  # when the last pass was handed to the engine thread
        self._cpu: tuple[float, float] | None = None  # (process, engine thread) CPU seconds at the last pass
        self.engine_clock: int | None = None  # the engine thread's CPU clock (`thread_clock`), once known

    def idle(self, seconds: float) -> None:
        """The worker waited `seconds` for work to arrive: not overhead."""
        self._idle += seconds

    def arrived(self, at: float | None = None, received: float | None = None) -> None:
        """Activations from a peer were queued (now, unless `at`); `received`: when its handler had the message."""
        at = time.perf_counter() if at is None else at
        if received is not None and received <= at:
            self._add("hop_accept", "hop_accepts", at - received)
        self._arrivals.append(at)

    def submitted(self, at: float | None = None) -> None:
        """A pass was handed to the engine thread (now, unless `at`)."""
        self._submitted = time.perf_counter() if at is None else at

    def applied(self, ended: float, at: float | None = None) -> None:
        """The loop took up (now, unless `at`) a pass the engine thread ended at `ended`."""
        at = time.perf_counter() if at is None else at
        if at >= ended:
            self._add("loop_wake", "loop_wakes", at - ended)

    def ran(self, began: float, ended: float) -> None:
        """A pass ran on the engine thread from `began` to `ended` (perf_counter: one clock for every thread)."""
        c = self.counters
        if self.last_end is not None and (gap := began - self.last_end - self._idle) >= 0:
            c["outside_us_total"] += round(gap * 1e6)
            c["outside_passes"] += 1
        waited = [t for t in self._arrivals if t <= began]
        c["hop_in_us_total"] += round(sum(began - t for t in waited) * 1e6)
        c["hop_in"] += len(waited)
        if (handed := self._submitted) is not None and handed <= began:  # else a pass run on by the engine thread
            queued = [t for t in waited if t <= handed]
            c["hop_queue_us_total"] += round(sum(handed - t for t in queued) * 1e6)
            c["hop_queued"] += len(queued)
            self._add("engine_wake", "engine_wakes", began - handed)
            self._submitted = None
        self._arrivals = [t for t in self._arrivals if t > began]
        self.last_end, self._idle = ended, 0.0

    def sent(self, called: float, answered: float, handed: float | None = None) -> None:
        """A call carrying activations was made at `called`, its message handed to gRPC's write at `handed` (if
        known) and answered at `answered`."""
        c = self.counters
        if self.last_end is not None and called >= self.last_end:
            c["hop_out_us_total"] += round((called - self.last_end) * 1e6)
            c["hop_out"] += 1
        if handed is not None and called <= handed:
            self._add("hop_write", "hop_writes", handed - called)
        self._add("hop_send", "hop_sends", answered - called)

    def _add(self, total: str, count: str, seconds: float) -> None:
        self.counters[f"{total}_us_total"] += round(seconds * 1e6)
        self.counters[count] += 1

    def read_cpu(self) -> None:
        """After a pass: the CPU clocks read (nothing where the engine thread's clock is unknown)."""
        if self.engine_clock is not None:
            self.cpu(time.process_time(), time.clock_gettime(self.engine_clock))

    def cpu(self, process: float, engine: float) -> None:
        """After a pass: CPU seconds used so far by the whole process and by its engine thread."""
        if self._cpu is not None:
            c, (p0, e0) = self.counters, self._cpu
            c["cpu_outside_us_total"] += round((process - p0 - (engine - e0)) * 1e6)
            c["cpu_engine_us_total"] += round((engine - e0) * 1e6)
            c["cpu_passes"] += 1
        self._cpu = (process, engine)


def thread_clock(ident: int) -> int | None:
    """The CPU-time clock of thread `ident` (threading.get_ident()), or None where there is none (macOS)."""
    try:
        return time.pthread_getcpuclockid(ident)
    except (AttributeError, OSError):
        return None
