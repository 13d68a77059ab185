"""Runs a check on gloo ranks spawned from pytest (no launcher), and fails the test with what
every rank raised (``spawn_ranks``), or returns it (``run_ranks``) where raising is the test."""

from __future__ import annotations

import gc
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(
    rank: int,
    world: int,
    port: int,
    checks: Callable[..., None],
    args: tuple,
    failures,
    group_timeout_s: float | None = None,
):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = None if group_timeout_s is None else timedelta(seconds=group_timeout_s)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        checks(rank, world, *args)
    except BaseException as exc:  # reported to the parent, which fails the test
        failures.put((rank, f"rank {rank}: {exc!r}\n{traceback.format_exc()}"))
    finally:
        torch.distributed.destroy_process_group()
    # torch 2.13's gloo worker threads free a finished collective's tensors on their own
    # thread. If that happens while the interpreter finalizes, taking the GIL ends the thread
    # through a noexcept destructor and the rank dies of SIGABRT ("terminate called without an
    # active exception"; pytorch/pytorch#190489, seen here about one run in 30). So the rank
    # collects its garbage (the process group's destructor drains and joins those threads)
    # while the interpreter is alive, and leaves without finalizing: its report is already in
    # the queue's pipe.
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(checks: Callable[..., None], world: int, *args: Any) -> None:
    """Calls ``checks(rank, world, *args)`` on ``world`` gloo processes (a module-level
    function: spawn pickles it by name) and asserts that no rank raised."""
    failures = torch.multiprocessing.get_context("spawn").SimpleQueue()
    torch.multiprocessing.spawn(
        _rank, args=(world, free_port(), checks, args, failures), nprocs=world
    )
    problems = []
    while not failures.empty():
        problems.append(failures.get()[1])
    assert not problems, "\n".join(problems)


def run_ranks(
    checks: Callable[..., None],
    world: int,
    *args: Any,
    group_timeout_s: float,
    deadline_s: float,
) -> list[str | None]:
    """Calls ``checks(rank, world, *args)`` on ``world`` gloo processes whose process group
    times out after ``group_timeout_s``, and returns what each rank raised (its repr and
    traceback; None where its check returned). Fails the test where a rank dies of a signal
    (SIGABRT included: torch's join names it) or the ranks outlive ``deadline_s`` (then
    killed): a hung collective cannot hang the test."""
    failures = torch.multiprocessing.get_context("spawn").SimpleQueue()
    context = torch.multiprocessing.spawn(
        _rank,
        args=(world, free_port(), checks, args, failures, group_timeout_s),
        nprocs=world,
        join=False,
    )
    end = time.monotonic() + deadline_s
    while not context.join(timeout=max(0.0, min(1.0, end - time.monotonic()))):
        if time.monotonic() >= end:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise AssertionError(f"the {world} ranks still ran after {deadline_s} s: a hang")
    reports: list[str | None] = [None] * world
    while not failures.empty():
        rank, report = failures.get()
        reports[rank] = report
    return reports
