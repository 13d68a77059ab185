"""How many intra-op threads a CPU build runs with (``FLEXMASK_BUILD_THREADS``, default 1),
and the context that sets it for one build."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from flexmask._validate import env_int

ENV_BUILD_THREADS = "FLEXMASK_BUILD_THREADS"


def build_threads() -> int:
    """Intra-op threads a CPU build runs with: FLEXMASK_BUILD_THREADS, default 1."""
    threads = env_int(ENV_BUILD_THREADS, 1, minimum=1)
    assert threads is not None  # a default is given
    return threads


@contextlib.contextmanager
def cpu_threads(device: torch.device) -> Iterator[None]:
    """Runs a build on ``build_threads()`` intra-op threads where it is on the CPU and torch
    would use more, restoring torch's setting after.

    A tile build is a few dozen tensor ops, each one pass over the tile grid: with every
    core busy (DataLoader workers, say) each parallel op waits for a descheduled thread,
    and one thread is the faster (docs/blocks.md §7, ``benchmarks/bench_threads.py``)."""
    wanted = build_threads()
    previous = torch.get_num_threads()
    if device.type != "cpu" or wanted >= previous:
        yield
        return
    torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
