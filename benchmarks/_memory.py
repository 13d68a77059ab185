"""Peak extra CPU memory of a call, two ways.

``peak_extra_bytes``: from torch's allocator events. ``ru_maxrss`` is a process-wide
high-water mark, so it cannot see a 32 MB peak after setup already touched 200 MB. The profiler
reports every tensor allocation and free with its size; replaying them in order gives the peak
number of live bytes the call added. It sees the calling thread's allocations only.

``peak_rss_bytes``: the resident-set high-water mark of the whole process (every thread: the
OpenMP workers inside SDPA, the block-sparse path's helper threads), reset just before the call
through ``/proc/self/clear_refs`` (Linux >= 4.0), minus the resident set at that moment; glibc's
``malloc_trim`` first returns the heap's free pages, so the starting point is the live memory
(what the call frees and reuses inside itself stays resident: a high-water mark, as a peak is).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import re
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

_libc: ctypes.CDLL | None = None


def _release_free_heap() -> None:
    """Hands the heap's free pages back to the kernel (glibc ``malloc_trim``), so the resident
    set is the live memory when a measurement starts."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"))
    _libc.malloc_trim(0)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        found = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if found is None:
        raise RuntimeError(f"/proc/self/status has no {field}: peak_rss_bytes needs Linux")
    return int(found.group(1)) << 10


def peak_rss_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Runs ``fn()`` once and returns (how far the process's resident set rose above its size
    at the call, every thread counted; its result). Linux with glibc only."""
    gc.collect()
    _release_free_heap()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    before = _status("VmRSS")
    result = fn()
    return _status("VmHWM") - before, result


def peak_extra_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Runs ``fn()`` once and returns (peak bytes of tensors it held at once, its result).

    Tensors still alive when ``fn`` returns (its result) count toward the peak too.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    # Allocations are charged to the op that made them ("self" memory), frees to "[memory]"
    # events; replaying both in time order gives the live bytes at every moment.
    events = [e for e in prof.events() if e.self_cpu_memory_usage != 0]
    events.sort(key=lambda e: e.time_range.start)
    live = peak = 0
    for event in events:
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak, result


if __name__ == "__main__":
    import threading

    peak, _ = peak_extra_bytes(lambda: torch.ones(1024, 1024).sum())
    print(f"allocator: {peak / 2**20:.2f} MiB (expect ~4 MiB)")

    def in_a_thread() -> None:
        worker = threading.Thread(target=lambda: torch.ones(8 << 20).sum())  # 32 MiB
        worker.start()
        worker.join()

    peak, _ = peak_extra_bytes(in_a_thread)
    print(f"allocator, another thread: {peak / 2**20:.2f} MiB (the profiler misses it)")
    peak, _ = peak_rss_bytes(in_a_thread)
    print(f"resident set, another thread: {peak / 2**20:.2f} MiB (expect ~32 MiB)")
