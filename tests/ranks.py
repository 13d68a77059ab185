"""Runs a check on gloo ranks spawned from pytest (no launcher), and fails the test with what
every rank raised."""

from __future__ import annotations

import gc
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, checks: Callable[..., None], args: tuple, failures):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        checks(rank, world, *args)
    except BaseException as exc:  # reported to the parent, which fails the test
        failures.put(f"rank {rank}: {exc!r}\n{traceback.format_exc()}")
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
        problems.append(failures.get())
    assert not problems, "\n".join(problems)
