"""Re-making an equal tree mask and hitting the cache, against building it (issue #32).

An RL step re-makes ``tree(parents)`` from its data every step; when the trees recur (the same
prompts' responses) the cache should serve them for next to nothing. Per size, at B = 8 (one
tree per row, rows differ), two layouts (preorder: a prompt then 8 responses, as
``pack_one_tree`` lays them out; insertion: a trie numbered as inserted, AReaL's layout) and the
parents given two ways (a list of Python int lists; one ``(B, S)`` int64 tensor;
``--parents rows`` a list of 1-D tensors, as ``pack_tree_batch`` gives them), in one run:

* make + hit: ``tree(parents)`` of a new copy of the parents (made untimed, as a step's new
  data), then ``MaskCache.get`` of it, a hit;
* build: ``create_block_mask`` of an equal mask made just before, its order (preorder ranks,
  subtree ends) read before the timing: the build as it was when a tree computed its order
  when made, the denominator of the ratio;
* fresh build: the same of a mask whose order is not known yet (since issue #32 the build
  computes it);
* make + build: both, timed together (a miss from the data: the same work before and after);
* list → tensor (lists only): the exact conversion alone of the same new lists (a scan of
  their types and one ``array('q')``, ``flexmask._validate.plain_ints``): the floor of
  make + hit from Python lists, whatever the key does after.

Repeats are interleaved (make + hit several times, then one of each build) and
each column is the median: other processes load the machine, and a burst then hits every
column alike; the ratio of the best times is printed beside (under a load of several
processes a core, a median can be several times the best). The load average is printed with
each row. glibc's malloc is first put in the
state a training process reaches after its first step (``common.settle_allocator``).

    python benchmarks/bench_tree_keys.py                    # 4k, 32k, 131k
    python benchmarks/bench_tree_keys.py --sizes 4096 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from bench_build import insertion_tree
from common import (
    fmt_time,
    machine,
    markdown_table,
    ratio,
    response_tree,
    save_json,
    settle_allocator,
)

import flexmask
from flexmask._validate import plain_ints

LAYOUTS: dict[str, Callable[[int, int], list[int]]] = {
    "preorder": response_tree,
    "insertion": insertion_tree,
}


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def case(S: int, B: int, layout: str, given: str, repeats: int, hits: int) -> dict[str, Any]:
    rows = [LAYOUTS[layout](S, seed) for seed in range(B)]
    table = torch.tensor(rows, dtype=torch.int64)

    def parents() -> Any:  # a new copy each time: equal data, no object shared with the cache
        if given == "lists":
            return [list(r) for r in rows]
        if given == "rows":  # one 1-D tensor per row, as pack_tree_batch' TreeBatch holds them
            return [r.clone() for r in table]
        return table.clone()

    def make_hit(data: Any) -> None:
        cache.get(flexmask.tree(data), B, 1, S, S, "cpu")

    def make_build(data: Any) -> None:
        flexmask.create_block_mask(flexmask.tree(data), B, 1, S, S, "cpu")

    cache = flexmask.MaskCache()
    cache.get(flexmask.tree(parents()), B, 1, S, S, "cpu")
    times: dict[str, list[float]] = {
        "make_hit": [],
        "build": [],
        "fresh": [],
        "make_build": [],
        "convert": [],
    }
    for _ in range(repeats):
        # The step's new data is made untimed: the timing is flexmask's part.
        times["make_hit"] += [timed(partial(make_hit, parents())) for _ in range(hits)]
        if given == "lists":
            times["convert"] += [timed(partial(plain_ints, parents())) for _ in range(hits)]
        ordered = flexmask.tree(parents())
        _ = ordered.preorder  # the order, computed (or, before issue #32, made with the mask)
        build = partial(flexmask.create_block_mask, ordered, B, 1, S, S, "cpu")
        times["build"].append(timed(build))
        fresh = partial(flexmask.create_block_mask, flexmask.tree(parents()), B, 1, S, S, "cpu")
        times["fresh"].append(timed(fresh))
        times["make_build"].append(timed(partial(make_build, parents())))
    info = cache.info()
    if info.misses != 1 or info.hits != repeats * hits:
        raise RuntimeError(f"expected one miss then hits only, got {info}")
    return dict(
        S=S,
        B=B,
        layout=layout,
        given=given,
        make_hit_s=statistics.median(times["make_hit"]),
        build_s=statistics.median(times["build"]),
        fresh_build_s=statistics.median(times["fresh"]),
        make_build_s=statistics.median(times["make_build"]),
        best_make_hit_s=min(times["make_hit"]),
        convert_s=statistics.median(times["convert"]) if times["convert"] else None,
        best_build_s=min(times["build"]),
        load=os.getloadavg()[0],
    )


def result_table(rows: list[dict[str, Any]]) -> str:
    return markdown_table(
        [
            "S",
            "B",
            "layout",
            "parents",
            "make + hit",
            "build",
            "fresh build",
            "make + build",
            "(make + hit) / build",
            "best / best",
            "(make + hit) / (make + build)",
            "list → tensor",
            "(list → tensor) / build",
            "load",
        ],
        [
            [
                f"{r['S']:,}",
                r["B"],
                r["layout"],
                r["given"],
                fmt_time(r["make_hit_s"]),
                fmt_time(r["build_s"]),
                fmt_time(r["fresh_build_s"]),
                fmt_time(r["make_build_s"]),
                ratio(r["make_hit_s"], r["build_s"], 3),
                ratio(r["best_make_hit_s"], r["best_build_s"], 3),
                ratio(r["make_hit_s"], r["make_build_s"], 3),
                fmt_time(r["convert_s"]),
                ratio(r["convert_s"], r["build_s"], 3),
                f"{r['load']:.1f}",
            ]
            for r in rows
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument(
        "--parents", nargs="+", default=["lists", "tensor"], choices=["lists", "tensor", "rows"]
    )
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds (medians)")
    parser.add_argument("--hits", type=int, default=5, help="make + hit calls per round")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    settle_allocator()  # malloc as a training process has it after its first step
    print(f"# Re-made tree masks: make + cache hit against a build\n\n{machine()}\n")
    rows = []
    for size in args.sizes:
        for layout in args.layouts:
            for given in args.parents:
                row = case(size, args.batch, layout, given, args.repeats, args.hits)
                rows.append(row)
                print(
                    f"  S={size:>6} B={args.batch} {layout:>9} {given:>6}: make + hit "
                    f"{fmt_time(row['make_hit_s']):>9} build {fmt_time(row['build_s']):>9} "
                    f"({ratio(row['make_hit_s'], row['build_s'], 3)}; best "
                    f"{ratio(row['best_make_hit_s'], row['best_build_s'], 3)}) "
                    + (
                        f"list → tensor {fmt_time(row['convert_s'])} "
                        f"({ratio(row['convert_s'], row['build_s'], 3)}) "
                        if row["convert_s"] is not None
                        else ""
                    )
                    + f"load {row['load']:.1f}",
                    flush=True,
                )
    print()
    print(result_table(rows))
    print(
        f"\nMedians (and best: best / best) of {args.repeats} interleaved rounds "
        f"({args.hits} make + hit calls each), {torch.get_num_threads()} threads."
    )
    save_json(args.json, {"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
