"""What a lowering to another kernel's format costs, against the BlockMask build of the mask.

A training step on new data lowers its mask once per micro-batch: ``to_varlen``,
``to_magi``, ``to_flashmask``, or the ``slices`` backend's lowering (``to_magi`` and its
kernel calls; on the CPU ``flexmask.flex_attention`` runs it wherever it takes the mask).
This benchmark times each beside the peer it stands in for — flexmask's own BlockMask build
of the same mask at the same size (``flexmask.create_block_mask``) — in one run, interleaved,
medians of ``--repeat`` rounds with every cache cleared before each call, and prints the
load. Per-row documents, a sliding window, shared-prefix trees and a union (a window with
attention sinks) at 8k and 131k, B = 1 and 8.

The process first allocates and frees 16 MiB, as every training process has freed far larger
tensors: glibc then keeps freed memory of a few hundred KiB for reuse, where a fresh process
gives each freed per-token tensor back to the OS and takes page faults to use it again
(hundreds per lowering, a few per build, whose tensors are per block).
``--fresh-allocator`` measures without it.

Where a lowering's output is bigger than the BlockMask (varlen's per-token gather indices,
FlashMask's per-column bounds), writing the output alone can cost more than the build:
``floor`` times a copy of the lowering's output tensors (the write, nothing computed).

Run from the repository root::

    OMP_NUM_THREADS=1 python benchmarks/bench_lowering.py            # 8k and 131k
    OMP_NUM_THREADS=1 python benchmarks/bench_lowering.py --quick    # 8k only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]

import torch  # noqa: E402
from common import documents, fmt_time, machine, markdown_table, response_tree  # noqa: E402

import flexmask  # noqa: E402
from flexmask.backends import slices  # noqa: E402
from flexmask.formats import to_flashmask, to_magi, to_varlen, validated_window  # noqa: E402
from flexmask.formats._structure import lines  # noqa: E402

WINDOW = 1024


def cases(sizes: list[int], batches: list[int]) -> list[tuple[str, flexmask.Mask, int, int]]:
    """(name, mask, B, S): rows differ when B > 1."""
    out = []
    for S in sizes:
        for B in batches:

            def rows(make: Callable[[int], Any], B: int = B) -> Any:
                return [make(r) for r in range(B)] if B > 1 else make(0)

            docs = rows(lambda r, S=S: documents(S, r, S // 128))
            sinks = rows(lambda r, S=S: S // 64 + 16 * r)
            out += [
                ("documents", flexmask.causal() & flexmask.document(docs), B, S),
                ("window", flexmask.causal() & flexmask.sliding_window(WINDOW), B, S),
                ("tree", flexmask.tree(rows(lambda r, S=S: response_tree(S, r))), B, S),
                (
                    "window | sinks",
                    flexmask.causal() & (flexmask.sliding_window(WINDOW) | flexmask.prefix(sinks)),
                    B,
                    S,
                ),
            ]
    return out


def _slices(mask: flexmask.Mask, B: int, S: int) -> Any:
    return slices._lowered(mask, B, S, S)


LOWERINGS: dict[str, Callable[[flexmask.Mask, int, int], Any]] = {
    "to_varlen": lambda m, B, S: to_varlen(m, B, 1, S, S),
    "to_magi": lambda m, B, S: to_magi(m, B, 1, S, S),
    "to_flashmask": lambda m, B, S: to_flashmask(m, B, 1, S),
    "slices": _slices,
}


def intervals(mask: flexmask.Mask, B: int, S: int) -> Any:
    """Every query's attended keys as a few intervals, read from the mask's structure
    (``lines``): the pass ``to_magi``, ``to_flashmask`` and the slices backend start with
    below 32k lines, and ``to_varlen``'s check; from 32k lines (queries times rows that
    differ) they read stretches of queries instead (``formats/_stretches.py``)."""
    return lines(mask, validated_window(B if (mask.rows or 1) > 1 else 1, S, S))


def build(mask: flexmask.Mask, B: int, S: int) -> Any:
    return flexmask.create_block_mask(mask, B, 1, S, S, device="cpu")


def outputs(lowered: Any) -> list[Any]:
    """The tensors a lowering returns (the slices backend's are Python tuples)."""
    if isinstance(lowered, str | slices.Slices):
        return []
    return [v for v in vars(lowered).values() if hasattr(v, "clone")]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    flexmask.cache_clear()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def attempt(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except ValueError as err:
        return str(err)


def describe(lowered: Any) -> str:
    if isinstance(lowered, str):
        return "refuses"
    if isinstance(lowered, slices.Slices):
        return f"{len(lowered)} calls"
    if hasattr(lowered, "num_sequences"):
        return f"{lowered.num_sequences} seqs"
    if hasattr(lowered, "num_slices"):
        return f"{lowered.num_slices} slices"
    return f"C={lowered.columns}"


def measure(mask: flexmask.Mask, B: int, S: int, repeat: int) -> list[str]:
    """One row: per lowering its median time, ratio to the build's and floor's."""
    funcs = {name: (lambda f=f: attempt(lambda: f(mask, B, S))) for name, f in LOWERINGS.items()}
    results = {name: fn() for name, fn in funcs.items()}  # warm up, and say what each gives
    build(mask, B, S)
    times: dict[str, list[float]] = {name: [] for name in [*funcs, "build", "intervals"]}
    floors: dict[str, list[float]] = {name: [] for name in funcs}
    for _ in range(repeat):  # interleaved: load changes hit all alike
        times["build"].append(timed(lambda: build(mask, B, S))[0])
        times["intervals"].append(timed(lambda: attempt(lambda: intervals(mask, B, S)))[0])
        for name, fn in funcs.items():
            times[name].append(timed(fn)[0])
            tensors = outputs(results[name])
            floors[name].append(timed(lambda t=tensors: [x.clone() for x in t])[0])
    built, fastest = statistics.median(times["build"]), min(times["build"])
    cells = [fmt_time(built)]
    per_token = statistics.median(times["intervals"])
    cells.append(f"{fmt_time(per_token)} ({per_token / built:.2f}x)")
    for name in funcs:
        t = statistics.median(times[name])
        low = min(times[name]) / fastest
        cell = f"{fmt_time(t)} ({t / built:.2f}x; min {low:.2f}x), {describe(results[name])}"
        if outputs(results[name]):
            cell += f", floor {statistics.median(floors[name]) / built:.2f}x"
        cells.append(cell)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8k only")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--masks", nargs="+", help="only these mask names")
    parser.add_argument(
        "--fresh-allocator", action="store_true", help="skip freeing 16 MiB first (see above)"
    )
    args = parser.parse_args()
    if not args.fresh_allocator:
        torch.empty(16 << 20, dtype=torch.uint8).fill_(1)  # made, written, freed
    sizes = [8192] if args.quick else [8192, 131072]
    allocator = "fresh" if args.fresh_allocator else "16 MiB freed first"
    print(f"machine: {machine()}; allocator: {allocator}; load before {os.getloadavg()[0]:.1f}")
    rows = []
    for name, mask, B, S in cases(sizes, args.batches):
        if args.masks and name not in args.masks:
            continue
        rows.append([name, B, f"{S:,}", *measure(mask, B, S, args.repeat)])
        print(rows[-1], flush=True)
    print(f"load after {os.getloadavg()[0]:.1f}")
    header = ["mask", "B", "S", "BlockMask build", "intervals", *LOWERINGS]
    print(markdown_table(header, rows))
    print(
        f"medians of {args.repeat} interleaved rounds, caches cleared before each call; "
        "ratios to the build's median (min: fastest to fastest, what bursts of load leave "
        "alone); floor: copying the lowering's output tensors; intervals: every query's "
        "attended keys as intervals, the pass to_magi, to_flashmask and slices start with "
        "below 32k lines (from 32k they read stretches of queries)"
    )


if __name__ == "__main__":
    main()
