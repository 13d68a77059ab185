"""How a CPU backend's many small ops share the CPU: torch's intra-op threads, or groups
dealt to single-threaded workers, measured per call kind (``ThreadChoice``); one intra-op
thread while other processes keep cores busy (``others_busy``, ``one_thread``). Shared by the
block-sparse and slices backends, below both."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

import torch

from flexmask._cores import CORES, CoreLoad, at_most_threads
from flexmask._cores import others_busy as cores_busy

# ``workers`` for run_groups: choose per call between the two ways (see ThreadChoice).
AUTO = 0


class ThreadChoice:
    """Which of two ways ran a kind of call faster lately: torch's intra-op threads in every
    op of the calling thread ("torch"), or the groups dealt to single-threaded workers
    ("workers").

    Neither wins everywhere (``benchmarks/bench_sparse_threads.py``; docs/costs.md, "The
    thresholds in the code"): on free cores torch's threads are faster; with one other busy
    process they are slower, every op waiting for a descheduled thread. What the cores are free
    for changes while a job runs (DataLoader workers, other jobs), and the load average lags
    a minute behind, so the choice is measured: each kind of call (forward or backward, and
    its score elements to within a factor of 2) runs the way whose recent seconds per
    element are lowest, and tries the other way again after ``first`` calls, then after
    twice as many each time the probe loses (at most ``most``): settled, probing a slower way
    costs a few percent.

    With a ``load`` (the default choice, :data:`CHOICE`, has one), the cores are looked at
    first: while other processes keep at least ``BUSY_CORES`` (0.9) of a core of those
    torch's threads need busy, every call runs on the workers and torch's threads are
    neither used nor probed, so a probe never lands on a busy core (where it costs several
    calls' time). Its window is ``CoreLoad.period``, not the load average's minute: it
    follows what the cores are free for now. Results are the same either way: only the time
    differs.
    """

    WAYS = ("torch", "workers")

    def __init__(self, first: int = 4, most: int = 64, load: CoreLoad | None = None) -> None:
        self.first, self.most = first, most
        self.load = load
        self.lock = threading.Lock()
        self.kinds: dict[tuple[str, int], _Kind] = {}

    def pick(self, kind: tuple[str, int]) -> str:
        if self._others_busy():
            # torch's threads need every core: with another process on one, each op waits
            # for a descheduled thread. Neither run nor probed until it leaves.
            return "workers"
        with self.lock:
            state = self.kinds.setdefault(kind, _Kind(self.first))
            for way in self.WAYS:  # each way once, first
                if way not in state.cost:
                    return way
            best = min(self.WAYS, key=state.cost.__getitem__)
            if state.since >= state.interval:
                return self.WAYS[1 - self.WAYS.index(best)]  # try the other way again
            return best

    def _others_busy(self) -> bool:
        """Whether other processes took at least ``BUSY_CORES`` of a core of those torch's
        threads need (the ``load``'s latest window); False without a ``load`` or where it
        cannot read."""
        return self.load is not None and cores_busy(self.load)

    def record(self, kind: tuple[str, int], way: str, seconds_per_unit: float) -> None:
        with self.lock:
            state = self.kinds.setdefault(kind, _Kind(self.first))
            if len(state.cost) < len(self.WAYS):
                state.cost[way] = seconds_per_unit
                return
            best = min(self.WAYS, key=state.cost.__getitem__)
            if way == best:
                state.cost[way] = (state.cost[way] + seconds_per_unit) / 2
                state.since += 1
                return
            # A probe of the other way: it takes over when it beats the incumbent's recent
            # cost, and is tried again soon; otherwise later, up to ``most`` calls.
            state.cost[way] = seconds_per_unit
            state.since = 0
            won = seconds_per_unit < state.cost[best]
            state.interval = self.first if won else min(2 * state.interval, self.most)

    def way(self, kind: tuple[str, int]) -> str | None:
        """The way this kind of call runs now, once both were measured (for reports)."""
        with self.lock:
            state = self.kinds.get(kind)
            if state is None or len(state.cost) < len(self.WAYS):
                return None
            return min(self.WAYS, key=state.cost.__getitem__)


class _Kind:
    """Per kind of call: recent seconds per score element of each way, and the probe timer."""

    def __init__(self, interval: int) -> None:
        self.cost: dict[str, float] = {}
        self.since = 0
        self.interval = interval


CHOICE = ThreadChoice(load=CORES)


def _after_fork_in_child() -> None:
    """A child (a DataLoader worker) must not inherit a held lock, nor its parent's last load
    sample (its own CPU time starts again from zero)."""
    CHOICE.lock = threading.Lock()
    if CHOICE.load is not None:
        CHOICE.load.lock = threading.Lock()
        CHOICE.load.last = CHOICE.load.value = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def run_groups(
    one: Callable[[int], None],
    costs: list[int],
    workers: int,
    direction: str = "forward",
) -> None:
    """Calls ``one(index)`` for every group (``costs``: each one's score elements), on
    ``workers`` threads of one intra-op thread each (``AUTO``: the way :data:`CHOICE` picks
    for this call).

    A group is a dozen small ops (gathers, a matmul, passes over its scores). Run with torch's
    intra-op threads, each op waits at its end for the slowest thread, and on a machine whose
    cores are busy (DataLoader workers, other jobs) a descheduled thread stalls every op, and
    the path loses to SDPA where on one thread it wins (docs/costs.md). So
    the groups can be dealt to ``workers`` threads by cost, each single-threaded, which meet
    once at the end. With one worker (or grad mode on, as in a double backward, which must
    record the ops) the groups run here, in order, under one intra-op thread.
    """
    if not costs:
        return
    if workers == AUTO:
        if torch.get_num_threads() == 1 or torch.is_grad_enabled() or len(costs) == 1:
            in_this_thread(one, len(costs))
            return
        elements = sum(costs)
        kind = (direction, elements.bit_length())
        way = CHOICE.pick(kind)
        start = time.perf_counter()
        if way == "torch":
            in_this_thread(one, len(costs))
        else:
            run_groups(one, costs, torch.get_num_threads())
        CHOICE.record(kind, way, (time.perf_counter() - start) / max(elements, 1))
        return
    workers = max(1, min(workers, len(costs)))
    if torch.is_grad_enabled():
        workers = 1
    # Largest first to the least loaded: costs are the score elements of each group.
    shares: list[list[int]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for index in sorted(range(len(costs)), key=lambda i: -costs[i]):
        least = loads.index(min(loads))
        shares[least].append(index)
        loads[least] += costs[index]
    inference = torch.is_inference_mode_enabled()
    errors: list[BaseException] = []

    def work(share: list[int]) -> None:
        for index in sorted(share):
            one(index)

    def own_thread(share: list[int]) -> None:
        try:
            # A new thread starts with torch's default thread count and grad mode on (grad
            # and inference mode are per thread; inference_mode(False) would turn grad mode
            # on, hence one or the other). It ends after this: nothing to restore.
            torch.set_num_threads(1)
            with torch.inference_mode() if inference else torch.no_grad():
                work(share)
        except BaseException as error:  # re-raised by the caller's thread
            errors.append(error)

    threads = [threading.Thread(target=own_thread, args=(share,)) for share in shares[1:]]
    for thread in threads:
        thread.start()
    try:
        with one_thread():
            work(shares[0])
    finally:
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]


def others_busy() -> bool:
    """Whether other processes keep at least ``BUSY_CORES`` of a core of those torch's
    intra-op threads need busy (``CHOICE``'s window): where they do, a kernel that cannot deal
    its work to the workers runs on one intra-op thread, as each op's threads would otherwise
    wait for a descheduled one."""
    return CHOICE._others_busy()


def in_this_thread(one: Callable[[int], None], count: int) -> None:
    """Every group here, in order, with torch's intra-op threads in each op."""
    for index in range(count):
        one(index)


def one_thread() -> contextlib.AbstractContextManager[None]:
    """One intra-op thread in this thread (OpenMP's count is per thread), restored after."""
    return at_most_threads(1)


def kernel_workers(threads: int | None, device: torch.device) -> int:
    """``workers`` for the kernel. Its threads are a CPU matter (torch's intra-op threads);
    elsewhere the groups run in the calling thread, which also keeps them on the caller's
    stream (a helper thread would launch on its own default stream, unordered with it)."""
    if device.type != "cpu":
        return 1
    return AUTO if threads is None else threads
