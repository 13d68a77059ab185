"""Context parallel that moves only what each rank reads, against the all-gather.

Run: python benchmarks/bench_cp_exchange.py [--sizes 32768,131072] [--worlds 4,8]
     [--cases documents,window,tree] [--heads 2] [--dim 32] [--repeat 3] [--quick]
     [--bytes-only] [--json PATH]

Two parts, both in one run:

1. Bytes (one process, every rank's plan from every rank's shard): for each case, balancer,
   S and W, the keys each rank receives under ``plan_exchange`` against the all-gather's
   ``(W - 1) S / W``, beside the issue's bound for that case, computed here independently
   from the token positions each rank holds:
   - documents: the keys of the documents that straddle the rank's positions, outside them
     (what a rank must receive whatever the exchange);
   - window: the window's halo, ``(w - 1)`` keys before each run of consecutive positions the
     rank holds;
   - tree: the ancestors of the rank's tokens held by other ranks (the plan should equal it);
   - causal (the all-gather's case, timed with the exchange forced): every earlier key.
2. Time (``W`` gloo processes on this machine's cores): per rank, the exchange alone
   (forward and backward of K/V) and a step (``cp_flex_attention`` forward + backward) with
   ``exchange="needed"`` and ``"all_gather"``, interleaved, the max over ranks of each
   repeat's time, median over repeats; every rank checks the two outputs agree.

The machine line and the 1-minute load average are printed before and after: the ranks share
the cores, so a loaded machine inflates both columns alike.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from common import fmt_bytes, fmt_time, machine, markdown_table, save_json

import flexmask
from flexmask.context_parallel import PerDocumentBalancer, exchange_from_block_masks

WINDOW = 2048


def documents(S: int, seed: int, unit: int = 16) -> list[int]:
    """Documents of mixed lengths (``unit`` to 4096 tokens, most short: much shorter than
    S / W), multiples of ``unit`` (the per-document balancer's 2W), filling S."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < S:
        lengths.append(unit * max(1, int(rng.lognormvariate(5.5, 1.0)) // unit))
    lengths = [min(n, 4096) for n in lengths]
    while sum(lengths) > S:
        over = sum(lengths) - S
        lengths[-1] -= min(over, lengths[-1] - unit)
        if sum(lengths) > S:
            lengths.pop()
    lengths[-1] += S - sum(lengths)
    return lengths


def grpo_trees(S: int, seed: int) -> list[int]:
    """Parents of GRPO groups packed in one row: each a prompt (64-4096 tokens) and 4-8
    responses (64-2048 tokens) branching off its last token, laid out in preorder."""
    rng = random.Random(seed)
    parents: list[int] = []
    while len(parents) < S:
        prompt = rng.randint(64, 4096)
        start = len(parents)
        parents += [-1] + [start + i for i in range(prompt - 1)]
        for _ in range(rng.randint(4, 8)):
            first = len(parents)
            size = rng.randint(64, 2048)
            parents += [start + prompt - 1] + [first + i for i in range(size - 1)]
    return parents[:S]


def case_mask(name: str, S: int) -> tuple[flexmask.Mask, Any]:
    """(mask, what its bound needs: document lengths, the window, or the parents)."""
    if name == "documents":
        lengths = documents(S, 0)
        return flexmask.causal() & flexmask.document(lengths), lengths
    if name == "window":
        return flexmask.causal() & flexmask.sliding_window(WINDOW), WINDOW
    if name == "tree":
        parents = grpo_trees(S, 0)
        return flexmask.tree(parents), parents
    if name == "causal":  # the all-gather's case: the last queries read every key
        return flexmask.causal(), None
    raise ValueError(name)


def balancers(name: str, extra: Any, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"head_tail": "head_tail", "contiguous": None}
    if name == "documents":
        out["per_document"] = PerDocumentBalancer([extra], world)
    out["mask_aware"] = "mask_aware"
    return out


def bound(name: str, extra: Any, held: torch.Tensor, S: int) -> int:
    """The issue's bound for a rank holding original positions ``held`` (see the module
    docstring), counted from the positions alone; causal: every earlier key held elsewhere."""
    held = held[held < S]
    mine = torch.zeros(S, dtype=torch.bool)
    mine[held] = True
    if name == "documents":
        doc = torch.repeat_interleave(torch.arange(len(extra)), torch.tensor(extra))
        touched = torch.zeros(len(extra), dtype=torch.bool)
        touched[doc[held]] = True
        return int((touched[doc] & ~mine).sum())
    if name == "causal":
        return int((~mine[: int(held.max()) + 1]).sum()) if held.numel() else 0
    if name == "window":
        ordered = held.sort().values
        runs = 1 + int((ordered.diff() != 1).sum()) if ordered.numel() else 0
        return runs * (extra - 1)
    parents = extra  # tree: every ancestor of a held token, held elsewhere
    need = mine.clone().tolist()
    for i in range(S - 1, -1, -1):
        if need[i] and parents[i] >= 0:
            need[parents[i]] = True
    return int((torch.tensor(need) & ~mine).sum())


def bytes_part(args: argparse.Namespace) -> list[dict]:
    rows = []
    for S in args.sizes:
        for world in args.worlds:
            for name in args.cases:
                mask, extra = case_mask(name, S)
                for label, balancer in balancers(name, extra, world).items():
                    start = time.perf_counter()
                    shards = [
                        flexmask.shard(
                            mask,
                            1,
                            1,
                            S,
                            world_size=world,
                            rank=r,
                            balancer=balancer,
                            BLOCK_SIZE=args.block,
                        )
                        for r in range(world)
                    ]
                    built = time.perf_counter() - start
                    start = time.perf_counter()
                    plan = exchange_from_block_masks([s.block_mask for s in shards], 0)
                    planned = time.perf_counter() - start
                    limits = [bound(name, extra, s.indices[0, s.local], S) for s in shards]
                    received = list(plan.received)
                    rows.append(
                        {
                            "case": name,
                            "balancer": label,
                            "S": S,
                            "W": world,
                            "received_max": max(received),
                            "received_mean": sum(received) / world,
                            "gathered": plan.gathered,
                            "bound_max": max(limits),
                            "within_bound": all(
                                r <= b for r, b in zip(received, limits, strict=True)
                            ),
                            "equals_bound": received == limits,
                            "auto_needed": plan.needed,
                            "shards_s": built,
                            "plan_s": planned,
                        }
                    )
                    print(
                        f"  {name} {label} S={S} W={world}: max {max(received)} / "
                        f"{plan.gathered} keys, bound {max(limits)}",
                        flush=True,
                    )
    return rows


def print_bytes(rows: list[dict], args: argparse.Namespace) -> None:
    per_key = 2 * args.heads * args.dim * 4  # K and V, float32
    table = []
    for r in rows:
        table.append(
            [
                r["case"],
                r["balancer"],
                r["S"],
                r["W"],
                fmt_bytes(r["received_max"] * per_key),
                fmt_bytes(r["received_mean"] * per_key),
                fmt_bytes(r["gathered"] * per_key),
                f"{r['received_max'] / r['gathered']:.3f}",
                f"{r['bound_max'] / r['gathered']:.3f}",
                "= bound" if r["equals_bound"] else ("yes" if r["within_bound"] else "NO"),
                "needed" if r["auto_needed"] else "all-gather",
                fmt_time(r["shards_s"] + r["plan_s"]),
            ]
        )
    header = [
        "case",
        "balancer",
        "S",
        "W",
        "most received (a rank)",
        "mean received",
        "all-gather (each rank)",
        "most / all-gather",
        "bound / all-gather",
        "every rank within bound",
        "auto",
        "W shards + plan",
    ]
    print(f"\nBytes each rank receives (K and V, H={args.heads}, D={args.dim}, float32):\n")
    print(markdown_table(header, table))


# ------------------------------------------------------------------------------ timed part
def _rank(rank: int, world: int, port: int, configs: list[tuple], args: Any, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for config in configs:
            results.put((rank, config, _time_config(rank, world, config, args)))
    finally:
        dist.destroy_process_group()


def _time_config(rank: int, world: int, config: tuple, args: Any) -> dict:
    from torch.distributed.tensor.experimental._context_parallel._cp_custom_ops import (
        flex_cp_allgather,
    )

    from flexmask.context_parallel import plan_exchange
    from flexmask.context_parallel.exchange import exchange_kv

    S, name, label = config
    mask, extra = case_mask(name, S)
    balancer = balancers(name, extra, world)[label]
    dist.barrier()
    start = time.perf_counter()
    plan = plan_exchange(
        mask,
        1,
        args.heads,
        S,
        world_size=world,
        rank=rank,
        balancer=balancer,
        BLOCK_SIZE=args.block,
    )
    planned = time.perf_counter() - start
    local = plan.shard.padded_length // world
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (
        torch.randn(1, args.heads, local, args.dim, generator=gen).requires_grad_(True)
        for _ in range(3)
    )
    grad = torch.randn(1, args.heads, local, args.dim, generator=gen)
    group = dist.group.WORLD
    name_of = dist.distributed_c10d._get_process_group_name(group)

    def move(mode: str) -> None:
        if mode == "needed":
            got = exchange_kv(k, v, plan, 2, group)
        else:
            got = flex_cp_allgather(k, v, 2, name_of)
        (got[0].sum() + got[1].sum()).backward()

    def step(mode: str) -> torch.Tensor:
        out = flexmask.cp_flex_attention(q, k, v, plan, exchange=mode, compile=False)
        out.backward(grad)
        return out.detach()

    times: dict[str, list[float]] = {}
    outs = {}
    for repeat in range(args.repeat + 1):  # the first round warms up
        modes = ("needed", "all_gather") if repeat % 2 else ("all_gather", "needed")
        for what, fn in (("move", move), ("step", step)):
            for mode in modes:
                dist.barrier()
                start = time.perf_counter()
                result = fn(mode)
                dist.barrier()  # the slowest rank's time
                if repeat:
                    times.setdefault(f"{what}_{mode}", []).append(time.perf_counter() - start)
                if what == "step":
                    outs[mode] = result
    torch.testing.assert_close(outs["needed"], outs["all_gather"], atol=1e-5, rtol=1e-5)
    return {
        "plan_s": planned,
        **{key: statistics.median(values) for key, values in times.items()},
        "received": plan.received[rank],
        "gathered": plan.gathered,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(args: argparse.Namespace) -> list[dict]:
    rows = []
    for world in args.worlds:
        configs = [(S, name, label) for S in args.sizes for name, label in args.timed]
        results = torch.multiprocessing.get_context("spawn").SimpleQueue()
        start = time.perf_counter()
        torch.multiprocessing.spawn(
            _rank, args=(world, _free_port(), configs, args, results), nprocs=world
        )
        print(f"  W={world}: {time.perf_counter() - start:.0f} s", flush=True)
        by_config: dict[tuple, list[dict]] = {}
        while not results.empty():
            _, config, result = results.get()
            by_config.setdefault(config, []).append(result)
        for (S, name, label), per_rank in by_config.items():
            row = {"S": S, "W": world, "case": name, "balancer": label}
            for key in per_rank[0]:
                row[key] = max(r[key] for r in per_rank)  # the slowest rank, the most bytes
            rows.append(row)
    return rows


def print_times(rows: list[dict], args: argparse.Namespace) -> None:
    table = []
    for r in rows:
        table.append(
            [
                r["case"],
                r["balancer"],
                r["S"],
                r["W"],
                f"{r['received'] / r['gathered']:.3f}",
                fmt_time(r["move_needed"]),
                fmt_time(r["move_all_gather"]),
                f"{r['move_needed'] / r['move_all_gather']:.2f}",
                fmt_time(r["step_needed"]),
                fmt_time(r["step_all_gather"]),
                f"{r['step_needed'] / r['step_all_gather']:.2f}",
                fmt_time(r["plan_s"]),
            ]
        )
    header = [
        "case",
        "balancer",
        "S",
        "W",
        "received / all-gather (most)",
        "K/V moved fwd+bwd: needed",
        "all-gather",
        "ratio",
        "step fwd+bwd: needed",
        "all-gather",
        "ratio",
        "plan (W shards)",
    ]
    print(
        f"\nTime on {args.worlds} gloo ranks, max over ranks, median of {args.repeat} "
        f"(H={args.heads}, D={args.dim}, BLOCK_SIZE={args.block}, float32):\n"
    )
    print(markdown_table(header, table))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="32768,131072")
    parser.add_argument("--worlds", default="4,8")
    parser.add_argument("--cases", default="documents,window,tree,causal")
    parser.add_argument(
        "--timed",
        default="documents:head_tail,documents:contiguous,window:head_tail,window:contiguous,"
        "tree:head_tail,causal:head_tail",
        help="case:balancer pairs timed on gloo ranks",
    )
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--bytes-only", action="store_true")
    parser.add_argument("--quick", action="store_true", help="S = 8k, W = 4, one repeat")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.worlds, args.repeat = "8192", "4", 1
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.worlds = [int(w) for w in args.worlds.split(",")]
    args.cases = args.cases.split(",")
    args.timed = [tuple(pair.split(":")) for pair in args.timed.split(",") if pair]
    torch.set_num_threads(1)
    print(machine())
    print(f"load average at start: {os.getloadavg()[0]:.1f}", flush=True)
    print(f"command: python {' '.join(sys.argv)}\n")
    size_rows = bytes_part(args)
    print_bytes(size_rows, args)
    time_rows: list[dict] = []
    if not args.bytes_only:
        print(f"\nload average before the gloo runs: {os.getloadavg()[0]:.1f}", flush=True)
        time_rows = timed(args)
        print_times(time_rows, args)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    save_json(args.json, {"machine": machine(), "bytes": size_rows, "times": time_rows})


if __name__ == "__main__":
    main()
