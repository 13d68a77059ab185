"""How many of this process's cores other processes keep busy: what a CPU build and the CPU
backends read before choosing how many intra-op threads to run on (below every layer that
chooses: ``builders.threads``, ``backends.threads``)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import torch

# How much of a core other processes must keep busy for every call to go to the workers: a
# whole spinning process (1 core) does; the demo's DataLoader workers' bursts mostly do not,
# and a lower bar sent their calls to the slower way (docs/costs.md, "The thresholds in the
# code").
BUSY_CORES = 0.9


class CoreLoad:
    """How many of this process's cores other processes kept busy lately, from the kernel's
    own counters: the busy ticks of the cores this process may run on (``/proc/stat``, for
    ``os.sched_getaffinity``) less this process's CPU time (``time.process_time``: its
    spinning OpenMP threads count as its own), over the wall time between two samples.

    A sample costs one read of ``/proc/stat`` (tens of microseconds) and is taken at most once
    per ``period`` seconds; in between the last value stands. Where the counters cannot be
    read (no ``/proc``), :meth:`others` is None and nothing is decided from it.
    """

    def __init__(self, period: float = 0.2) -> None:
        self.period = period
        self.lock = threading.Lock()
        self.last: tuple[float, float, float] | None = None  # wall, busy cores-s, own cpu-s
        self.value: float | None = None
        try:
            self.cpus: frozenset[int] | None = frozenset(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = None

    def _busy_seconds(self) -> float | None:
        """Seconds the allowed cores spent in anything but idle and iowait since boot."""
        try:
            with open("/proc/stat", "rb") as stat:
                lines = stat.read(1 << 20).split(b"\n")
        except OSError:
            return None
        busy = 0
        for line in lines:
            if not line.startswith(b"cpu") or line[3:4] == b" ":
                if busy or not line.startswith(b"cpu"):
                    break  # the per-core lines come right after the total
                continue
            fields = line.split()
            if self.cpus is not None and int(fields[0][3:]) not in self.cpus:
                continue
            ticks = [int(f) for f in fields[1:9]]
            busy += sum(ticks) - ticks[3] - ticks[4]  # less idle and iowait
        return busy / _TICKS

    def others(self) -> float | None:
        """Cores other processes kept busy over the latest window (0 to the core count)."""
        now = time.monotonic()
        with self.lock:
            if self.last is not None and now - self.last[0] < self.period:
                return self.value
            busy = self._busy_seconds()
            if busy is None:
                return None
            own = time.process_time()
            if self.last is not None:
                wall = now - self.last[0]
                taken = (busy - self.last[1]) - (own - self.last[2])
                self.value = max(0.0, taken / wall)
            self.last = (now, busy, own)
            return self.value


try:
    _TICKS = float(os.sysconf("SC_CLK_TCK"))
except (AttributeError, ValueError, OSError):
    _TICKS = 100.0


CORES = CoreLoad()
"""The process's one sampler (a sample is shared by every caller within its period)."""


def others_busy(load: CoreLoad = CORES, busy: float = BUSY_CORES, unknown: bool = False) -> bool:
    """Whether other processes keep at least ``busy`` of a core of those torch's intra-op
    threads need busy (the ``load``'s latest window); ``unknown`` where the counters cannot
    be read or no window has passed yet (a process's first call)."""
    others = load.others()
    if others is None:
        return unknown
    cores = len(load.cpus) if load.cpus is not None else os.cpu_count() or 1
    return cores - others < min(torch.get_num_threads(), cores) - busy


@contextlib.contextmanager
def at_most_threads(count: int) -> Iterator[None]:
    """At most ``count`` intra-op threads in this thread (OpenMP's count is per thread),
    torch's setting restored after; nothing changed where it is ``count`` or fewer."""
    previous = torch.get_num_threads()
    if count >= previous:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
