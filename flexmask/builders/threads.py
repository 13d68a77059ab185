"""How many intra-op threads a CPU build runs with (``FLEXMASK_BUILD_THREADS``; unset:
torch's own count, or one while other processes keep a core busy), and the context that
sets it for one build."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from flexmask._cores import at_most_threads, others_busy
from flexmask._validate import env_int

ENV_BUILD_THREADS = "FLEXMASK_BUILD_THREADS"

# Half a core kept busy by others sends a build to one thread. The bar is lower than the
# attention backends' (``_cores.BUSY_CORES``): a busy process sharing the cores with a
# build's own threads shows as less than a core, and two threads on busy cores cost a build
# more (up to several times) than one thread on free cores does (docs/costs.md, "Builds on
# the write's cores"). Unknown (a process's first build, no /proc) is one thread, as before.
BUSY = 0.5


def build_threads() -> int | None:
    """Intra-op threads a CPU build runs with: FLEXMASK_BUILD_THREADS, or None (unset:
    chosen per build by ``cpu_threads``)."""
    return env_int(ENV_BUILD_THREADS, None, minimum=1)


@contextlib.contextmanager
def cpu_threads(device: torch.device) -> Iterator[None]:
    """Runs a build on the CPU with ``build_threads()`` intra-op threads where set and fewer
    than torch's; unset, on torch's threads while the cores are free and on one while other
    processes keep a core busy, restoring torch's setting after.

    A build is a few dozen tensor ops, each a pass over the tile grid or the BlockMask's
    tensors. On free cores torch's threads share each pass (the long builds' writes most:
    docs/costs.md, "Builds on the write's cores"); with a core busy (DataLoader workers, say)
    each parallel op waits for a descheduled thread, and one thread is the faster
    (``benchmarks/bench_threads.py``)."""
    previous = torch.get_num_threads()
    wanted = build_threads()
    if wanted is None:
        busy = device.type == "cpu" and previous > 1 and others_busy(busy=BUSY, unknown=True)
        wanted = 1 if busy else previous
    with at_most_threads(wanted) if device.type == "cpu" else contextlib.nullcontext():
        yield
