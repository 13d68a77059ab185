"""A build's two sides written at once, one on a second thread (``side_by_side``).

A long build's write is a few dozen passes, many of them serial in torch (cumsums, scatters,
the chunk tables of ``runs.expand_runs``): on two intra-op threads those leave a core idle,
and each parallel pass waits at its barrier for a thread another process has descheduled.
The kv side and the q side of a BlockMask share nothing once the tiles are known, so each
is written on its own thread with half the intra-op threads: the serial passes of one side
run beside those of the other, and neither waits for the other until both are done.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from flexmask.blocks.runs import exporting

A = TypeVar("A")
B = TypeVar("B")

SPLIT_FROM = 1 << 20
"""Grids of at least this many tiles (rows x heads x q blocks x kv blocks) write their sides
on two threads: below, a thread's start and the sides' calls sharing the GIL cost more than
the overlap saves."""

_inside = threading.local()


def side_by_side(
    first: Callable[[], A], second: Callable[[], B], tiles: int, device: torch.device
) -> tuple[A, B]:
    """``(first(), second())``: ``second`` on a new thread while ``first`` runs on this
    one, each with half the intra-op threads, where the build runs on the CPU with two or
    more of them and its grid holds ``SPLIT_FROM`` tiles or more; else one after the other.

    Also in turn: under ``torch.export``, a dispatch or function mode (a fake tensor
    trace, an op counter: such modes are the calling thread's alone), and inside a side
    (no thread starts another). The new thread takes the caller's grad and inference
    mode; an exception raised by either side is raised here, once both have finished."""
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
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    done: dict[str, object] = {}

    def run() -> None:
        _inside.side = True
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                done["value"] = second()
        except BaseException as error:  # raised again on the calling thread
            done["error"] = error

    # A thread takes ATen's thread count at its first op: set before it starts.
    torch.set_num_threads(max(1, threads // 2))
    worker = threading.Thread(target=run, name="flexmask-side", daemon=True)
    _inside.side = True
    try:
        worker.start()
        value = first()
    finally:
        worker.join()
        _inside.side = False
        torch.set_num_threads(threads)
    if "error" in done:
        raise done["error"]  # type: ignore[misc]
    return value, done["value"]  # type: ignore[return-value]
