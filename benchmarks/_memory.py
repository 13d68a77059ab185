"""Peak extra CPU memory of a call, measured from torch's allocator events.

Why the profiler and not RSS: ``ru_maxrss`` is a process-wide high-water mark, so it cannot see a
32 MB peak after setup already touched 200 MB. The profiler reports every tensor allocation and
free with its size; replaying them in order gives the peak number of live bytes the call added.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


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
    peak, _ = peak_extra_bytes(lambda: torch.ones(1024, 1024).sum())
    print(f"{peak / 2**20:.2f} MiB (expect ~4 MiB)")
