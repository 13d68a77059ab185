"""What the ranks' agreement costs (docs/context-parallel.md, "What it costs").

Two gloo ranks, one thread each: ``cp_flex_attention`` forward (``compile=False``, the
all-gather path, ``causal & document([S/4, S/4, S/2])``, head-tail, BLOCK_SIZE 128) against
the agreement alone on the same inputs (its fixed-size status and all-gather), the status
alone, and torch's key/value all-gather. Medians of ``--reps`` calls (a quarter of them at
S = 8192); the load average is printed before and after.

    python benchmarks/bench_cp_agreement.py
    python benchmarks/bench_cp_agreement.py --sizes 256 2048 --reps 10
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import flexmask
from flexmask.context_parallel.agreement import agree, status

CONFIGS = {256: (2, 16), 2048: (4, 64), 8192: (8, 64)}
"""S -> (H, D), the rows of the docs' table."""


def _timed(fn: Callable[[], Any], reps: int) -> float:
    fn()
    dist.barrier()
    out = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def _row(rank: int, world: int, S: int, reps: int, group: Any, name: str) -> dict:
    from torch.distributed.tensor.experimental._context_parallel._cp_custom_ops import (
        flex_cp_allgather,
    )

    heads, dim = CONFIGS[S]
    mask = flexmask.causal() & flexmask.document([S // 4, S // 4, S // 2])
    shard = flexmask.shard(mask, 1, None, S, world_size=world, rank=rank, balancer="head_tail")
    q, k, v = (torch.randn(1, heads, S // world, dim) for _ in range(3))
    return {
        "call": _timed(lambda: flexmask.cp_flex_attention(q, k, v, shard, compile=False), reps),
        "agreement": _timed(lambda: agree(q, k, v, shard, None, False, group, world), reps),
        "status": _timed(lambda: status(q, k, v, shard, None, world), reps),
        "kv_allgather": _timed(lambda: flex_cp_allgather(k, v, 2, name), reps),
    }


def _rank(rank: int, world: int, port: int, sizes: list[int], reps: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        name = dist.distributed_c10d._get_process_group_name(group)
        for S in sizes:
            row = _row(rank, world, S, reps if S < 8192 else max(1, reps // 4), group, name)
            if rank == 0:
                results.put((S, *CONFIGS[S], row))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=sorted(CONFIGS))
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    unknown = [S for S in args.sizes if S not in CONFIGS]
    if unknown:
        parser.error(f"--sizes must be among {sorted(CONFIGS)}, got {unknown}")
    print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
    results = torch.multiprocessing.get_context("spawn").SimpleQueue()
    torch.multiprocessing.spawn(
        _rank, args=(2, _free_port(), args.sizes, args.reps, results), nprocs=2
    )
    print(
        "| S, H, D | call | agreement | of it: the status | keys/values all-gather | "
        "agreement / call |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    while not results.empty():
        S, heads, dim, r = results.get()
        ms = {key: f"{value * 1e3:.2f} ms" for key, value in r.items()}
        print(
            f"| {S}, {heads}, {dim} | {ms['call']} | {ms['agreement']} | {ms['status']} | "
            f"{ms['kv_allgather']} | {r['agreement'] / r['call']:.2%} |"
        )
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
