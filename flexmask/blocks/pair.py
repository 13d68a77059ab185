"""A build's two sides written at once, one on a second thread (``side_by_side``).

A long build's write is a few dozen passes, many of them serial in torch (cumsums, scatters,
the chunk tables of ``runs.expand_runs``): on two intra-op threads those leave a core idle,
and each parallel pass waits at its barrier for a thread another process has descheduled.
The kv side and the q side of a BlockMask share nothing once the tiles are known, so each
is written on its own thread with half the intra-op threads: the serial passes of one side
run beside those of the other, and neither waits for the other until both are done.

The second side runs on one long-lived thread, woken for each build (``_Worker``), not on a
thread started per build: right after a parallel op torch's OpenMP workers spin on the other
cores, and a new thread waited up to 4 ms for a core (its start blocks the caller meanwhile;
a woken sleeper preempts the spinner at once: 0.04 ms, docs/costs.md "The second side's
thread").
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from flexmask.blocks.runs import exporting

A = TypeVar("A")
B = TypeVar("B")

SPLIT_FROM = 1 << 20
"""Grids of at least this many tiles (rows x heads x q blocks x kv blocks) write their sides
on two threads: below, waking the second thread and the sides' calls sharing the GIL cost
more than the overlap saves."""

_inside = threading.local()


class _Worker:
    """The thread second sides run on: started at the first long build, then asleep on its
    queue between builds (a daemon: it never keeps the interpreter alive). One build uses
    it at a time (``busy``); a build that finds it taken starts a thread of its own."""

    def __init__(self) -> None:
        self.busy = threading.Lock()
        self.tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="flexmask-side", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        _inside.side = True  # nothing run here starts another side
        while True:
            self.tasks.get()()


_worker: _Worker | None = None
_worker_lock = threading.Lock()


def _forget_worker() -> None:
    """A forked child has no threads but the forking one: it starts its own worker."""
    global _worker, _worker_lock
    _worker, _worker_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_worker)


def _the_worker() -> _Worker:
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = _Worker()
        return _worker


def side_by_side(
    first: Callable[[], A], second: Callable[[], B], tiles: int, device: torch.device
) -> tuple[A, B]:
    """``(first(), second())``: ``second`` on the second-side thread while ``first`` runs
    on this one, each with half the intra-op threads, where the build runs on the CPU with
    two or more of them and its grid holds ``SPLIT_FROM`` tiles or more; else one after the
    other.

    Also in turn: under ``torch.export``, a dispatch or function mode (a fake tensor
    trace, an op counter: such modes are the calling thread's alone), and inside a side
    (no side starts another). ``second`` runs in the caller's grad and inference mode; an
    exception raised by either side is raised here, once both have finished."""
    threads = torch.get_num_threads()
    if (
        threads < 2
        or tiles < SPLIT_FROM
        or device.type != "cpu"
        or getattr(_inside, "side", False)
        or exporting()
        or _get_current_dispatch_mode() is not None
        or torch._C._is_torch_function_mode_enabled()
    ):
        return first(), second()
    half = max(1, threads // 2)
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    done: dict[str, Any] = {}
    finished = threading.Event()

    def run() -> None:
        try:
            # The intra-op count is each thread's own once it has run an op: set here.
            torch.set_num_threads(half)
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                done["value"] = second()
        except BaseException as error:  # raised again on the calling thread
            done["error"] = error
        finally:
            finished.set()

    worker = _the_worker()
    own = worker.busy.acquire(blocking=False)
    torch.set_num_threads(half)
    _inside.side = True
    try:
        if own:
            worker.tasks.put(run)
        else:  # another build's second side holds the worker: a thread of this build's own
            threading.Thread(target=_sided(run), name="flexmask-side-extra", daemon=True).start()
        value = first()
    finally:
        try:
            finished.wait()
        finally:  # an interrupt while waiting still frees the worker for later builds
            if own:
                worker.busy.release()
            _inside.side = False
            torch.set_num_threads(threads)
    if "error" in done:
        raise done["error"]
    return value, done["value"]


def _sided(run: Callable[[], None]) -> Callable[[], None]:
    """``run`` on a thread of its own, marked as a side (it starts none)."""

    def call() -> None:
        _inside.side = True
        run()

    return call
