"""Lazy handles and the mask cache: memory held across micro-batches, and what a lookup costs.

(a) Gradient accumulation over ``--micro-batches`` micro-batches at S = ``--seq-len`` (B=1, each
micro-batch with its own random documents, mask ``causal() & document(lens)``), with the masks
held three ways:

* eager: every BlockMask built up front and held until the last micro-batch's forward;
* lazy: one ``flexmask.lazy`` handle per micro-batch, built at its forward, released after
  (through the process-wide cache, as a training loop would);
* dense: one ``(1, 1, S, S)`` bool mask per micro-batch, as SDPA takes (allocated only when
  they fit in ``--dense-limit-gb``; otherwise only their size, n·S·S bytes, is reported).

The "forward" is a cheap op that reads the BlockMask; the memory measured is the masks', not
the model's. Bytes of BlockMasks are counted two ways: the brief's accounting (each built
handle's ``block_mask_nbytes`` plus ``cache_info().bytes``: the handle's BlockMask is also the
cached object, so it counts twice while built) and the distinct BlockMask objects alive at once
(tracked by weak references, each counted once). The allocator-level peak (``_memory``) covers
the whole loop, builds' temporaries included.

(b) The cost of a cache hit (``MaskCache.get`` on an equal mask made from different Python
objects), of a handle's first use on a miss (``flexmask.lazy(...).block_mask``) and of a plain
build (``flexmask.create_block_mask``), side by side. A hit is not free: ``get`` validates its
arguments against the mask and assembles the key; the key's content part (the document lengths,
or a digest for per-row data) is computed when the mask is made, so "make mask + hit" is the
cost a training step pays when it rebuilds an equal mask from its data. Each size runs at
B = 1 (one row of documents) and B = 8 (per-row documents: the key is every row's document
count and one digest of the lengths, made with the mask; a hit makes no grid and no tensor).

    python benchmarks/bench_lazy.py            # S = 16384 x 16 micro-batches; costs at 4k/16k/32k
    python benchmarks/bench_lazy.py --quick    # S = 4096 x 16; costs at 1k/4k (seconds)
"""

from __future__ import annotations

import argparse
import gc
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from _memory import peak_extra_bytes
from common import documents, fmt_bytes, fmt_time, machine, markdown_table, ratio, save_json
from torch.nn.attention.flex_attention import BlockMask

import flexmask
from flexmask.runtime.cache import block_mask_nbytes


def fake_forward(block_mask: BlockMask) -> int:
    """Stands in for a model's forward: reads the BlockMask, allocates next to nothing."""
    return int(block_mask.kv_num_blocks.sum()) + int(block_mask.full_kv_num_blocks.sum())


class Alive:
    """Weak references to every BlockMask built, to count the distinct ones still alive."""

    def __init__(self) -> None:
        self.refs: list[tuple[weakref.ref, int]] = []

    def add(self, block_mask: BlockMask) -> None:
        if not any(ref() is block_mask for ref, _ in self.refs):
            self.refs.append((weakref.ref(block_mask), block_mask_nbytes(block_mask)))

    def now(self) -> tuple[int, int]:
        """(count, bytes) of tracked BlockMasks alive now."""
        gc.collect()
        alive = [nbytes for ref, nbytes in self.refs if ref() is not None]
        return len(alive), sum(alive)


def eager_run(masks: list[flexmask.Mask], S: int, alive: Alive | None = None) -> dict[str, int]:
    held = [flexmask.create_block_mask(m, 1, 1, S, S, "cpu") for m in masks]
    peak_count = peak_bytes = 0
    for block_mask in held:
        fake_forward(block_mask)
        if alive is not None:
            alive.add(block_mask)
            count, nbytes = alive.now()
            peak_count, peak_bytes = max(peak_count, count), max(peak_bytes, nbytes)
    return dict(
        held_bytes=sum(block_mask_nbytes(b) for b in held),
        distinct_peak=peak_count,
        distinct_peak_bytes=peak_bytes,
    )


def lazy_run(masks: list[flexmask.Mask], S: int, alive: Alive | None = None) -> dict[str, int]:
    # Handles are made up front, as a DataLoader would hand them over: O(data) each.
    handles = [flexmask.lazy(m, 1, 1, S, S, "cpu") for m in masks]
    accounted = cache_peak = peak_count = peak_bytes = 0

    def sample() -> None:
        nonlocal accounted, cache_peak, peak_count, peak_bytes
        cached = flexmask.cache_info().bytes
        built = sum(block_mask_nbytes(h.block_mask) for h in handles if h.built)
        accounted, cache_peak = max(accounted, built + cached), max(cache_peak, cached)
        if alive is not None:
            count, nbytes = alive.now()
            peak_count, peak_bytes = max(peak_count, count), max(peak_bytes, nbytes)

    for handle in handles:
        with handle:  # built on first use below, released when the block ends
            fake_forward(handle.block_mask)
            if alive is not None:
                alive.add(handle.block_mask)
                sample()
        if alive is not None:
            sample()
    return dict(
        accounted_peak=accounted,
        cache_peak=cache_peak,
        distinct_peak=peak_count,
        distinct_peak_bytes=peak_bytes,
    )


def dense_run(masks: list[flexmask.Mask], S: int) -> int:
    held = [m.to_dense(1, 1, S, S, "cpu") for m in masks]
    return sum(t.numel() * t.element_size() for t in held)


def memory(S: int, n: int, dense_limit: float) -> dict[str, Any]:
    masks = [flexmask.causal() & flexmask.document(documents(S, seed)) for seed in range(n)]
    one = max(block_mask_nbytes(flexmask.create_block_mask(m, 1, 1, S, S, "cpu")) for m in masks)

    eager = eager_run(masks, S, Alive())
    eager["allocator_peak"], _ = peak_extra_bytes(lambda: eager_run(masks, S))

    flexmask.cache_clear()
    lazy = lazy_run(masks, S, Alive())
    flexmask.cache_clear()
    lazy["allocator_peak"], _ = peak_extra_bytes(lambda: lazy_run(masks, S))
    flexmask.cache_clear()

    cache = flexmask.runtime.default_cache()
    if cache.maxbytes is not None:
        bound, bound_text = cache.maxbytes, f"maxbytes = {fmt_bytes(cache.maxbytes)}"
    else:
        bound = cache.maxsize * one
        bound_text = f"{cache.maxsize} entries × {fmt_bytes(one)}, no byte bound set"

    dense_bytes = n * S * S
    dense: dict[str, Any] = dict(bytes=dense_bytes, allocated=False, allocator_peak=None)
    if dense_bytes <= dense_limit:
        dense["allocator_peak"], held = peak_extra_bytes(lambda: dense_run(masks, S))
        dense["allocated"] = held == dense_bytes
    return dict(
        S=S,
        micro_batches=n,
        one_block_mask=one,
        cache_bound=bound,
        cache_bound_text=bound_text,
        eager=eager,
        lazy=lazy,
        dense=dense,
        target_bytes=one + bound,
        passed=lazy["accounted_peak"] <= one + bound,
    )


def best(fn: Callable[[], Any], repeat: int, setup: Callable[[], Any] | None = None) -> float:
    """Best wall time of ``fn()`` over ``repeat`` calls (after one warm-up), ``setup`` untimed."""
    fn()
    result = float("inf")
    for _ in range(repeat):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        result = min(result, time.perf_counter() - start)
    return result


def costs(S: int, batch: int, repeat_fast: int, repeat_build: int) -> dict[str, Any]:
    """B = 1: one row of documents; B > 1: per-row documents (each row its own lengths), the
    mask a packed loader re-makes from its data every step."""
    rows = [documents(S, seed) for seed in range(batch)]
    data: Any = rows[0] if batch == 1 else rows

    def remade() -> flexmask.Mask:  # new lists, new pieces, new tree: equal, not identical
        return flexmask.causal() & flexmask.document(
            list(rows[0]) if batch == 1 else [list(r) for r in rows]
        )

    mask = flexmask.causal() & flexmask.document(data)
    equal = remade()
    if equal is mask or equal != mask:
        raise RuntimeError("the hit case needs an equal mask made from different objects")

    hit_cache = flexmask.MaskCache()
    hit_cache.get(mask, batch, 1, S, S, "cpu")
    hit = best(lambda: hit_cache.get(equal, batch, 1, S, S, "cpu"), repeat_fast)
    make = best(remade, repeat_fast)
    make_hit = best(lambda: hit_cache.get(remade(), batch, 1, S, S, "cpu"), repeat_fast)
    info = hit_cache.info()
    if info.misses != 1:
        raise RuntimeError(f"expected hits only after the first get, got {info}")

    miss_cache = flexmask.MaskCache()
    first_use = best(
        lambda: flexmask.lazy(mask, batch, 1, S, S, "cpu", cache=miss_cache).block_mask,
        repeat_build,
        setup=miss_cache.clear,
    )
    build = best(lambda: flexmask.create_block_mask(mask, batch, 1, S, S, "cpu"), repeat_build)
    return dict(
        S=S,
        B=batch,
        documents=sum(map(len, rows)),
        hit_s=hit,
        make_mask_s=make,
        make_mask_hit_s=make_hit,
        first_use_s=first_use,
        build_s=build,
        load=os.getloadavg()[0],
    )


def memory_table(mem: dict[str, Any]) -> str:
    """The memory table (printed here, and on the benchmark page)."""
    eager, lazy, dense = mem["eager"], mem["lazy"], mem["dense"]
    n = mem["micro_batches"]
    dense_note = "allocated" if dense["allocated"] else "n·S·S, too large to allocate here"
    return markdown_table(
        ["held as", "BlockMasks alive at once", "mask bytes at peak", "allocator peak (loop)"],
        [
            [
                "eager: all built up front",
                eager["distinct_peak"],
                fmt_bytes(eager["distinct_peak_bytes"]),
                fmt_bytes(eager["allocator_peak"]),
            ],
            [
                "lazy: a handle per micro-batch",
                lazy["distinct_peak"],
                f"{fmt_bytes(lazy['distinct_peak_bytes'])} (handles + cache: "
                f"{fmt_bytes(lazy['accounted_peak'])})",
                fmt_bytes(lazy["allocator_peak"]),
            ],
            [
                f"dense ({n}, 1, S, S) bool",
                n,
                f"{fmt_bytes(dense['bytes'])} ({dense_note})",
                fmt_bytes(dense["allocator_peak"]),
            ],
        ],
    )


def cost_table(rows: list[dict[str, Any]]) -> str:
    """The cost table (printed here, and on the benchmark page)."""
    return markdown_table(
        [
            "S",
            "B",
            "docs",
            "cache hit",
            "make mask",
            "make mask + hit",
            "handle first use (miss)",
            "build",
            "(make + hit) / build",
            "first use / build",
            "load",
        ],
        [
            [
                f"{r['S']:,}",
                r["B"],
                r["documents"],
                fmt_time(r["hit_s"]),
                fmt_time(r["make_mask_s"]),
                fmt_time(r["make_mask_hit_s"]),
                fmt_time(r["first_use_s"]),
                fmt_time(r["build_s"]),
                ratio(r["make_mask_hit_s"], r["build_s"], 2),
                ratio(r["first_use_s"], r["build_s"], 2),
                f"{r['load']:.1f}",
            ]
            for r in rows
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="S of the memory part (default 16384, --quick 4096)",
    )
    parser.add_argument("--micro-batches", type=int, default=16)
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=None,
        help="S of the cost part (default 4096 16384 32768, --quick 1024 4096)",
    )
    parser.add_argument(
        "--dense-limit-gb",
        type=float,
        default=4.0,
        help="allocate the dense masks only up to this many GB (10^9 bytes)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, fewer repeats")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    S = args.seq_len or (4096 if args.quick else 16384)
    sizes = args.sizes or ([1024, 4096] if args.quick else [4096, 16384, 32768])
    repeat_fast, repeat_build = (20, 3) if args.quick else (200, 10)
    n = args.micro_batches

    print(f"# Lazy handles and the mask cache\n\n{machine()}\n")
    mem = memory(S, n, args.dense_limit_gb * 1e9)
    eager, lazy, dense = mem["eager"], mem["lazy"], mem["dense"]
    print(f"## Mask memory, {n} micro-batches at S = {S:,} (B=1, causal & document)\n")
    print(memory_table(mem))
    print(
        f"\nOne micro-batch's BlockMask: {fmt_bytes(mem['one_block_mask'])}. Cache bound: "
        f"{fmt_bytes(mem['cache_bound'])} ({mem['cache_bound_text']}); the cache held at most "
        f"{fmt_bytes(lazy['cache_peak'])} during the loop. The handles + cache accounting counts "
        "the handle's BlockMask twice while it is built (it is also the cached object)."
    )
    print(
        f"\nTarget: lazy peak <= one micro-batch's BlockMask + the cache's bound: "
        f"{fmt_bytes(lazy['accounted_peak'])} <= {fmt_bytes(mem['target_bytes'])} "
        f"-> {'PASS' if mem['passed'] else 'FAIL'}"
    )
    held = eager["distinct_peak_bytes"] / max(1, lazy["distinct_peak_bytes"])
    print(
        f"Eager holds {held:.0f}x the BlockMask bytes lazy does; dense masks "
        f"{dense['bytes'] / max(1, eager['distinct_peak_bytes']):,.0f}x eager's.\n"
    )

    print(
        "## Cost of a cache hit, a re-made mask's hit, a handle's first use and a build "
        "(document-causal; B = 8: per-row documents)\n"
    )
    rows = []
    for size in sizes:
        for batch in (1, 8):
            row = costs(size, batch, repeat_fast, repeat_build)
            rows.append(row)
            print(
                f"  S={size:>6} B={batch} hit {fmt_time(row['hit_s']):>8} make + hit "
                f"{fmt_time(row['make_mask_hit_s']):>8} build {fmt_time(row['build_s']):>8} "
                f"load {row['load']:.1f}",
                flush=True,
            )
    print()
    print(cost_table(rows))
    print(
        "\nA hit validates the arguments against the mask and assembles the key from ints on "
        "every call (the lengths' digest is made with the mask); "
        "best of "
        f"{repeat_fast} calls (hits) and {repeat_build} (builds), {torch.get_num_threads()} "
        "threads."
    )
    save_json(
        args.json,
        {
            "machine": machine(),
            "memory": mem,
            "costs": rows,
            "repeats": {"hit": repeat_fast, "build": repeat_build},
        },
    )


if __name__ == "__main__":
    main()
